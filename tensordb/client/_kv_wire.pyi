"""The KV events' wire bytes, spliced natively from the store's event records
(tensordb/client/_kv_wire.c)."""

def splice(records: bytes, stored_head: bytes, removed_head: bytes, tail_host: bytes,
           tail_disk: bytes, no_info: bytes, /) -> tuple[bytes, int, bool] | None: ...
