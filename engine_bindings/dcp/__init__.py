"""``torch.distributed.checkpoint`` (DCP) on tensordb: a checkpoint is one version.

```python
import torch.distributed.checkpoint as dcp
from engine_bindings.dcp import TensorDBReader, TensorDBWriter

dcp.save(state_dict, storage_writer=TensorDBWriter(db, "llama"))      # every rank
dcp.load(state_dict, storage_reader=TensorDBReader(db, "llama", version=None))
```

The save commits one version through one group transaction of all the ranks (it appears
when every rank has committed its part; a rank that fails aborts it); the load reads
any version into any other sharding (DCP's planner computes which stored chunks each
rank's tensors overlap; each region is read with ``snap.slice``). What is stored:
``_layout``. Uses the public tensordb API only.
"""

from __future__ import annotations

from ._reader import TensorDBReader
from ._writer import TensorDBWriter

__all__ = ["TensorDBReader", "TensorDBWriter"]
