"""The ``tensordb`` command line: look into a store and maintain it.

Every command opens the store named by the global options (``--home``, ``--catalog``,
``--node``, ``--data-dir``), does one thing and closes it. A ``TensorDBError`` ends
the command with one red ``error: ...`` line on stderr and exit status 2; ``verify``
exits 1 when it finds a problem.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy.exc import OperationalError
from typer.core import TyperGroup

import query
from storage_engine import shm_root

from . import Database, connect
from ._display import TABLE_STYLE, history_table, human_bytes, result_table, shape_text
from .catalog import current_revision, ensure_schema, make_engine
from .client import find_areas, remove_area
from .config import Config
from .errors import NodeUnavailable, TensorDBError

__all__ = ["app", "main"]


def _console(*, stderr: bool = False) -> Console:
    # made per command, not at import: rich reads the terminal width when it is built
    console = Console(stderr=stderr, highlight=False, emoji=False, soft_wrap=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = 120  # a pipe or a file: no terminal to fit, keep rows whole
    return console


def _report(exc: TensorDBError) -> None:
    _console(stderr=True).print(f"error: {exc}", style="red", markup=False)


class _Group(TyperGroup):
    """Turns a TensorDBError raised by any command into ``error: ...`` and exit 2."""

    def invoke(self, ctx: Any) -> Any:  # click's Context, which typer does not re-export
        try:
            return super().invoke(ctx)
        except TensorDBError as exc:
            _report(exc)
            raise typer.Exit(2) from None


app = typer.Typer(
    name="tensordb",
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Versioned tensors in a shared store: inspect and maintain one.",
)
db_app = typer.Typer(no_args_is_help=True, help="Operations on the catalog database.")
app.add_typer(db_app, name="db")
policies_app = typer.Typer(no_args_is_help=True, help="Run stored policies and read their log.")
app.add_typer(policies_app, name="policies")


@dataclass(frozen=True, slots=True)
class _Where:
    """The store the global options name."""

    home: Path | None
    catalog: str | None
    node: str | None
    data_dir: Path | None

    def config(self) -> Config:
        return Config.resolve(self.catalog, home=self.home, node=self.node,
                              data_dir=self.data_dir)


def _where(ctx: typer.Context) -> _Where:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, _Where) else _Where(None, None, None, None)


@contextmanager
def _open(ctx: typer.Context) -> Iterator[Database]:
    w = _where(ctx)
    db = connect(w.catalog, home=w.home, node=w.node, data_dir=w.data_dir)
    try:
        yield db
    finally:
        db.close()


# -- the commands ----------------------------------------------------------------------
@app.callback()
def _root(
    ctx: typer.Context,
    home: Annotated[Path | None, typer.Option(
        "--home", help="The embedded store's directory (default: $TENSORDB_HOME, else "
        "./.tensordb).", show_default=False)] = None,
    catalog: Annotated[str | None, typer.Option(
        "--catalog", metavar="URL", help="SQLAlchemy URL of the catalog, e.g. "
        "postgresql+psycopg://host/tensordb (default: SQLite in the home directory).",
        show_default=False)] = None,
    node: Annotated[str | None, typer.Option(
        "--node", help="This host's node name (default: local).", show_default=False)] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", help="The disk tier's directory (default: HOME/data).",
        show_default=False)] = None,
) -> None:
    ctx.obj = _Where(home, catalog, node, data_dir)


@app.command("ls")
def ls_command(ctx: typer.Context) -> None:
    """List the collections with their head version, tensors and size."""
    out = _console()
    with _open(ctx) as db:
        table = Table(**TABLE_STYLE)
        table.add_column("collection", overflow="fold")
        table.add_column("head", justify="right", no_wrap=True)
        table.add_column("tensors", justify="right", no_wrap=True, min_width=7)
        table.add_column("size", justify="right", no_wrap=True)
        table.add_column("versions", justify="right", no_wrap=True, min_width=8)
        table.add_column("tags", overflow="fold")
        n = 0
        for name in db.collections():
            try:
                hist = db.history(name)
                tags = db.tags(name)
            except TensorDBError:  # dropped between the two looks
                continue
            n += 1
            if hist:
                head = hist[0]
                row = [str(head.version), str(head.tensors), human_bytes(head.nbytes)]
            else:
                row = ["-", "0", human_bytes(0)]
            table.add_row(escape(name), *row, str(len(hist)), escape(", ".join(tags)))
        if n == 0:
            out.print(f"no collections in {escape(str(db.config.home))}")
            return
        out.print(table)


@app.command("log")
def log_command(ctx: typer.Context,
                collection: Annotated[str, typer.Argument(help="The collection.")]) -> None:
    """Show a collection's history, newest first."""
    with _open(ctx) as db:
        commits = db.history(collection)
        tags = db.tags(collection)
    _console().print(history_table(commits, tags))


@app.command("show")
def show_command(
    ctx: typer.Context,
    collection: Annotated[str, typer.Argument(help="The collection.")],
    version: Annotated[int | None, typer.Option(
        "--version", "-v", help="The version (default: the head).", show_default=False)] = None,
    tag: Annotated[str | None, typer.Option("--tag", "-t", help="A tag instead of a version.")
                   ] = None,
) -> None:
    """List the tensors of one version: name, dtype, shape, bytes."""
    out = _console()
    with _open(ctx) as db, db.snapshot(collection, version=version, tag=tag) as snap:
        info = snap.info()
        v = snap.version
    table = Table(title=f"{escape(collection)} v{v}: {len(info)} tensors, "
                        f"{human_bytes(sum(i[2] for i in info.values()))}",
                  title_justify="left", **TABLE_STYLE)
    table.add_column("name", overflow="fold")
    table.add_column("dtype", no_wrap=True)
    table.add_column("shape", overflow="fold")
    table.add_column("nbytes", justify="right", no_wrap=True)
    for name, (dtype, shape, nbytes) in info.items():
        table.add_row(escape(name), dtype, shape_text(shape), str(nbytes))
    out.print(table)


@app.command("tag")
def tag_command(
    ctx: typer.Context,
    collection: Annotated[str, typer.Argument(help="The collection.")],
    tag: Annotated[str, typer.Argument(help="The tag's name.")],
    version: Annotated[int | None, typer.Option(
        "--version", "-v", help="The version to tag (default: the head).",
        show_default=False)] = None,
    delete: Annotated[bool, typer.Option("--delete", "-d", help="Remove the tag.")] = False,
) -> None:
    """Point a tag at a version (a tagged version is kept by gc), or delete it."""
    if delete and version is not None:
        raise typer.BadParameter("--delete takes no --version", param_hint="--version")
    out = _console()
    with _open(ctx) as db:
        if delete:
            db.untag(collection, tag)
            out.print(f"deleted tag {escape(tag)!r} of {escape(collection)}")
        else:
            v = db.tag(collection, tag, version=version)
            out.print(f"tagged {escape(collection)} v{v} as {escape(tag)!r}")


@app.command("gc")
def gc_command(ctx: typer.Context, release_pool: Annotated[bool, typer.Option(
        "--release-pool", help="Also give back the pool of freed shared-memory files kept "
        "for later writes (by default gc trims it to its bound).")] = False) -> None:
    """Reclaim the bytes no version, tag, lease or retention rule needs."""
    out = _console()
    with _open(ctx) as db, _console(stderr=True).status("collecting garbage..."):
        report = db.gc(keep_pool=not release_pool)
    table = Table(title="gc", title_justify="left", show_header=False, box=None,
                  pad_edge=False)
    table.add_column("what")
    table.add_column("how many", justify="right")
    for f in fields(report):
        value = getattr(report, f.name)
        text = (human_bytes(value) if f.name in ("bytes_freed", "pool_bytes", "pool_released")
                else str(value))
        table.add_row(f.name.replace("_", " "), text)
    out.print(table)


@app.command("verify")
def verify_command(ctx: typer.Context) -> None:
    """Check every stored tensor against its checksum; exit 1 if any is bad."""
    out = _console()
    with _open(ctx) as db:
        with _console(stderr=True).status("verifying checksums..."):
            problems = db.verify()
        stats = db.stats()
    if not problems:
        out.print(f"ok: {stats['segments']} segments, {human_bytes(stats['segment_bytes'])}, "
                  f"no problems")
        return
    table = Table(title=f"{len(problems)} problem(s)", title_justify="left",
                  **TABLE_STYLE)
    for col in ("collection", "version", "tensor", "segment", "tier", "problem"):
        table.add_column(col, overflow="fold")
    for p in problems:
        table.add_row(escape(p.collection), str(p.first_version), escape(p.tensor),
                      p.segment_id, p.tier, escape(p.reason))
    out.print(table)
    _console(stderr=True).print(f"verify: {len(problems)} tensor(s) fail their check",
                                style="red", markup=False)
    raise typer.Exit(1)


@app.command("orphans")
def orphans_command(
    remove: Annotated[bool, typer.Option(
        "--remove", help="Delete the orphans no process has open or mapped.")] = False,
    every: Annotated[bool, typer.Option(
        "--all", help="List every store's area, not only the orphans.")] = False,
) -> None:
    """List shared-memory areas whose store is gone (its home and data directory
    deleted), and with --remove delete them. Needs no store; looks in
    $TENSORDB_SHM_ROOT, else /dev/shm."""
    out = _console()
    areas = [a for a in find_areas() if every or a.orphan]
    removed = 0
    table = Table(title=f"{len(areas)} area(s) in {shm_root()}", title_justify="left",
                  **TABLE_STYLE)
    for col in ("area", "size", "home", "state"):
        table.add_column(col, overflow="fold")
    for a in areas:
        if not a.orphan:
            state = "in use" if a.home is not None else "no record of its store"
        elif a.users:
            state = f"orphan, open in process {', '.join(map(str, a.users))}"
        elif remove:
            remove_area(a)
            removed += 1
            state = "orphan, removed"
        else:
            state = "orphan"
        table.add_row(a.path.name, human_bytes(a.nbytes), escape(a.home or "?"), state)
    out.print(table)
    if remove:
        out.print(f"removed {removed} orphan area(s)")


def _param_value(text: str) -> object:
    """A --param value: an integer or number if it reads as one, else the string."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


@app.command("query")
def query_command(
    ctx: typer.Context,
    statement: Annotated[str, typer.Argument(
        help="One statement, e.g. \"SELECT name, nbytes FROM tensors WHERE collection = "
        "'llama'\"; or - to read statements separated by ';' from stdin.")],
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", metavar="NAME=VALUE",
        help="A value for :NAME in the statement (an integer or number if it reads as one, "
        "else a string). Repeat for more.")] = None,
) -> None:
    """Run statements of the query language and print their results as tables.

    SELECT over tensors, versions, collections, commits, tags, extents, nodes, leases,
    pins, kv_namespaces, policies, policy_runs; SNAPSHOT, REPLICATE, PIN, UNPIN, EVICT,
    DROP VERSIONS; EXPLAIN; CREATE POLICY, SHOW POLICIES, DROP POLICY.
    """
    params: dict[str, object] = {}
    for item in param or []:
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise typer.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--param")
        params[name.strip().lstrip(":")] = _param_value(value)
    if statement == "-":
        statements = query.parse_script(sys.stdin.read())
    else:
        statements = [query.parse(statement)]
    out = _console()
    with _open(ctx) as db:
        for k, stmt in enumerate(statements):
            result = query.execute(db, stmt, params)
            if len(statements) > 1:  # each result under its statement (a title would wrap)
                out.print(("\n" if k else "") + str(stmt), style="bold", markup=False)
            out.print(result_table(result))
            if result.num_rows == 0:
                out.print("(no rows)")


@app.command("import")
def import_command(
    ctx: typer.Context,
    collection: Annotated[str, typer.Argument(help="The collection to commit into.")],
    path: Annotated[str, typer.Argument(
        help="A .safetensors file, or a folder with model.safetensors.index.json; or an "
        "object URL, s3://bucket/prefix/ (credentials from the AWS environment).")],
    message: Annotated[str | None, typer.Option("--message", "-m")] = None,
    tier: Annotated[str | None, typer.Option(help="host or disk (default: the store's).")] = None,
    in_place: Annotated[bool, typer.Option(
        "--in-place", help="Commit the local files without copying them (a reflink where "
        "the filesystem has one, else a reference): keep them unchanged afterwards.")] = False,
    endpoint_url: Annotated[str | None, typer.Option(
        help="The S3 API endpoint of an s3:// URL (default: AWS, or AWS_ENDPOINT_URL).")
    ] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Go on from what an interrupted import of the same objects "
        "left (s3:// only).")] = False,
) -> None:
    """Import a safetensors checkpoint as one new version."""
    options = {"endpoint_url": endpoint_url} if endpoint_url else None
    if path.startswith("s3://"):
        extra: dict[str, object] = {"storage_options": options, "resume": resume}
    else:
        extra = {}
        if options is not None or resume:
            raise typer.BadParameter("--endpoint-url and --resume are for s3:// URLs")
    with _open(ctx) as db:
        c = db.import_safetensors(collection, path, message=message, tier=tier, progress=True,
                                  in_place=in_place, **extra)  # type: ignore[arg-type]
    _console().print(f"{escape(c.collection)} version {c.version}: {c.tensors} tensors, "
                     f"{human_bytes(c.nbytes)} ({c.written} written, "
                     f"{human_bytes(c.written_nbytes)})")


@app.command("export")
def export_command(
    ctx: typer.Context,
    collection: Annotated[str, typer.Argument(help="The collection to export.")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the files.")],
    version: Annotated[int | None, typer.Option("--version", "-v")] = None,
) -> None:
    """Export a version as safetensors files."""
    with _open(ctx) as db:
        paths = db.export_safetensors(collection, out_dir, version=version, progress=True)
    out = _console()
    for p in paths:
        out.print(escape(str(p)))


@app.command("checkout")
def checkout_command(
    ctx: typer.Context,
    collection: Annotated[str, typer.Argument(help="The model's collection.")],
    out_dir: Annotated[Path, typer.Argument(help="The folder to write (made if missing).")],
    version: Annotated[int | None, typer.Option("--version", "-v")] = None,
    tag: Annotated[str | None, typer.Option("--tag", "-t")] = None,
) -> None:
    """Write a version's files (config, tokenizer) and a tensordb.json marker: an engine
    started on the folder with --load-format tensordb reads its weights from the store."""
    with _open(ctx) as db:
        out = db.checkout(collection, out_dir, version=version, tag=tag)
    _console().print(f"{escape(str(out))}: vllm serve {escape(str(out))} --load-format "
                     f"tensordb")


@policies_app.command("run")
def policies_run_command(
    ctx: typer.Context,
    duration: Annotated[float | None, typer.Option(
        help="Stop after this many seconds (default: until interrupted).")] = None,
) -> None:
    """Run the store's policies (EVERY, CRON, ON COMMIT) in this process.

    One runner per store leads; others started beside it stand by and take over if
    it stops. Created and dropped policies are picked up while it runs.
    """
    import time

    out = _console(stderr=True)
    with _open(ctx) as db:
        runner = query.PolicyRunner(db)
        try:
            runner.start()
            out.print(f"running the policies of {escape(str(db.config.home))} "
                      f"({'leader' if runner.is_leader else 'standing by'}); Ctrl-C stops")
            deadline = None if duration is None else time.monotonic() + duration
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic())))
        except KeyboardInterrupt:
            pass
        finally:
            runner.stop()


@policies_app.command("log")
def policies_log_command(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(help="Only this policy's runs.")] = None,
    limit: Annotated[int, typer.Option(help="How many runs, newest first.")] = 20,
) -> None:
    """The latest policy runs and their outcomes."""
    with _open(ctx) as db:
        text = ("SELECT policy, attempt, started_at, finished_at, outcome, detail FROM policy_runs"
                + (" WHERE policy = :name" if name else "")
                + " ORDER BY started_at DESC LIMIT :limit")
        result = query.execute(db, text, {"name": name, "limit": limit} if name else {"limit": limit})
    _console().print(result_table(result))


@db_app.command("upgrade")
def db_upgrade_command(ctx: typer.Context) -> None:
    """Migrate the catalog's schema to this version of tensordb (connecting does it too)."""
    cfg = _where(ctx).config()
    engine = make_engine(cfg.catalog_url, synchronous=cfg.sqlite_synchronous)
    url = engine.url.render_as_string(hide_password=True)
    try:
        with engine.connect() as conn:
            before = current_revision(conn)
        ensure_schema(engine)
        with engine.connect() as conn:
            after = current_revision(conn)
    except OperationalError as exc:
        raise NodeUnavailable(f"the catalog at {url} does not answer: {exc.orig}") from exc
    finally:
        engine.dispose()
    out = _console()
    out.print(f"catalog: {escape(url)}")
    if before == after:
        out.print(f"revision {after}: already current")
    else:
        out.print(f"revision {before or 'none (empty catalog)'} -> {after}")


@app.command("demo")
def demo_command() -> None:
    """A tour on a throwaway store: commit, read zero-copy, commit a change.

    Commits a model, reads it from a second process without copying it, commits a
    version that changes one tensor and shows what the two versions share.
    """
    from ._demo import run

    run(_console())


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: run the app, and end any TensorDBError with exit status 2."""
    try:
        app(args=list(argv) if argv is not None else None, prog_name="tensordb")
    except TensorDBError as exc:  # raised outside a command, e.g. while closing
        _report(exc)
        sys.exit(2)


from . import _cli_quota, _cli_serve, _cli_tokens  # noqa: E402,F401 - register their commands

if __name__ == "__main__":
    # run as -m: the commands other modules register live on tensordb.cli's app, the
    # module of that name, not on this __main__ copy of it
    from tensordb.cli import main as _main

    _main()
