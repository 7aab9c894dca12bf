"""Data in object storage: ``s3://`` URLs read by TabularDataModule (in memory and streamed) as the files on disk are,
credentials and endpoint taken as the AWS tools take them, and every failure in one line naming the URL and its cause.

One local S3 server (moto's, on loopback, in its own process) serves the whole module: a bucket holding the Parquet,
CSV and gzip CSV files that tests/data/test_stream.py streams from disk, an IAM user allowed to read it and one
allowed nothing; authentication is enforced, as on AWS.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_rec.data import TabularDataModule
from lightning_rec.data import _filesystems as filesystems
from lightning_rec.testing.object_storage import LocalGCS, LocalS3, aws_env
from tests.data.test_stream import SCHEMA, _files, _Losses, _rids
from tests.helpers.models import tiny_dlrm

SPLIT = {"random": {"val": 0.2, "test": 0.1, "seed": 3}}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The server, the bucket ``clicks`` (``logs/``: a.parquet, b.csv, c.csv.gz, and notes.md, not a table) and the
    same files on disk; ``reader``: keys allowed to read, ``nobody``: keys allowed nothing."""
    disk = tmp_path_factory.mktemp("disk")
    files = _files(disk)
    with LocalS3() as server:
        server.upload("clicks", {f"logs/{Path(f).name}": f for f in files})
        (disk / "notes.md").write_text("not a table\n")
        server.upload("clicks", {"notes/notes.md": disk / "notes.md"})
        reader, nobody = server.user("reader", read=True), server.user("nobody", read=False)
        server.enforce_auth()
        yield SimpleNamespace(server=server, endpoint=server.endpoint, files=files, reader=reader, nobody=nobody)


@pytest.fixture
def reader(s3: SimpleNamespace) -> Iterator[SimpleNamespace]:
    """The environment of a user allowed to read the bucket (``AWS_ENDPOINT_URL`` and keys, as for the AWS CLI)."""
    with aws_env(s3.endpoint, *s3.reader):
        yield s3


URLS = ["s3://clicks/logs/a.parquet", "s3://clicks/logs/b.csv", "s3://clicks/logs/c.csv.gz"]


def _same(a: Any, b: Any) -> None:
    """Two datasets (or batches) hold the same rows: labels, dense values, every sparse feature's ids and lengths."""
    assert torch.equal(a.labels, b.labels) and torch.equal(a.dense_features, b.dense_features)
    fa, fb = a.sparse_features.to_dict(), b.sparse_features.to_dict()
    assert fa.keys() == fb.keys()
    for name in fa:
        assert torch.equal(fa[name].values(), fb[name].values()) and torch.equal(fa[name].lengths(), fb[name].lengths())


def _loader(dm: TabularDataModule, rank: int, world: int) -> Any:
    dm.setup("fit")
    dm.__dict__["rank_and_world_size"] = (rank, world)  # no trainer: this rank of that many
    return dm.dataloader("train")


@pytest.fixture(autouse=True)
def _rank_of_the_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        TabularDataModule,
        "rank_and_world_size",
        property(lambda self: self.__dict__.get("rank_and_world_size", (0, 1))),
    )


# ---- the server's tests (the slow tier: a server process) ------------------------------------------------------
@pytest.mark.dist
def test_in_memory_splits_from_s3_are_the_splits_from_disk(reader: SimpleNamespace) -> None:
    """``files: s3://bucket/prefix/*`` (Parquet row groups, CSV, gzip CSV) split by a rule: every split holds the
    rows, ids and values the same files on disk give."""
    remote = TabularDataModule(schema=SCHEMA, files="s3://clicks/logs/*", split=SPLIT)
    local = TabularDataModule(schema=SCHEMA, files=reader.files, split=SPLIT)
    for dm in (remote, local):
        dm.setup("fit")
    assert remote.vocabularies["tags"].values == local.vocabularies["tags"].values
    for split in ("train", "val", "test"):
        r, d = remote.split(split), local.split(split)
        assert len(r) == len(d) > 0
        _same(r[torch.arange(len(r))], d[torch.arange(len(d))])


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_streamed_batches_from_s3_are_the_batches_from_disk(reader: SimpleNamespace, world: int) -> None:
    """Streamed (Parquet row groups, CSV byte ranges, a gzip file), each rank's batches, in order, are those of the
    files on disk, and every row comes once."""
    kw: dict[str, Any] = dict(schema=SCHEMA, stream=True, chunk_bytes=600, batch_size=64, window=2)
    remote = TabularDataModule(train="s3://clicks/logs/", **kw)
    local = TabularDataModule(train=reader.files, **kw)
    seen = []
    for rank in range(world):
        r, d = list(_loader(remote, rank, world)), list(_loader(local, rank, world))
        assert len(r) == len(d) > 0
        for a, b in zip(r, d):
            _same(a, b)
        seen += _rids(r)
    assert sorted(seen) == list(range(1003))


@pytest.mark.dist  # 2 worker processes
def test_stream_workers_read_s3_with_the_credentials_of_the_loader_s_process(reader: SimpleNamespace) -> None:
    """Workers are forked from the fork server, which started before the credentials were set (as in a notebook
    that sets them after a first loader): they read with the loader's process's variables."""
    from lightning_rec._forkserver import forkserver_context

    with aws_env(None, None, None):
        forkserver_context()  # the server runs, without the bucket's endpoint and keys
    with aws_env(reader.endpoint, *reader.reader):
        kw: dict[str, Any] = dict(schema=SCHEMA, stream=True, chunk_bytes=600, batch_size=64, window=2)
        remote = TabularDataModule(train=URLS, num_workers=2, **kw)
        local = TabularDataModule(train=reader.files, **kw)
        r, d = list(_loader(remote, 0, 1)), list(_loader(local, 0, 1))
    assert sorted(_rids(r)) == list(range(1003))
    first = lambda batch: _rids([batch])[0]  # noqa: E731  (two workers deal the same batches in another order)
    for a, b in zip(sorted(r, key=first), sorted(d, key=first)):
        _same(a, b)


def _fit(data: dict[str, Any], ckpt_dir: Path | None = None, ckpt: Any = None, epochs: int = 1) -> list[float]:
    """The per-step losses of a small DLRM trained on ``data`` (1 rank, in this process)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_rec
    from lightning_rec.testing import QUIET_TRAINER

    dm = TabularDataModule(schema=SCHEMA, batch_size=100, **data)
    L.seed_everything(7)
    model = tiny_dlrm(dm, 1)
    losses = _Losses()
    callbacks: list[Any] = [losses.callback]
    kw = dict(QUIET_TRAINER)
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1, filename="{step}"))
        kw["enable_checkpointing"] = True
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lightning_rec.RecShardStrategy(),
        max_epochs=epochs,
        limit_val_batches=0,
        callbacks=callbacks,
        **kw,
    )
    trainer.fit(model, dm, ckpt_path=ckpt)
    return losses.losses


@pytest.mark.dist  # whole fits in this process
def test_training_from_s3_gives_the_losses_of_training_from_disk(reader: SimpleNamespace) -> None:
    memory = _fit({"files": "s3://clicks/logs/*", "split": SPLIT})
    assert len(memory) == 8 and memory == _fit({"files": reader.files, "split": SPLIT})
    streamed = {"stream": True, "chunk_bytes": 600}
    remote = _fit({"train": "s3://clicks/logs/*", "val": URLS[:1], **streamed})
    assert len(remote) == 11 and remote == _fit({"train": reader.files, "val": reader.files[:1], **streamed})


@pytest.mark.dist  # whole fits in this process
def test_a_streamed_epoch_from_s3_resumes_exactly_mid_epoch(reader: SimpleNamespace, tmp_path: Path) -> None:
    """A checkpoint at step 8 of the first of two epochs: the resumed run trains the batches the checkpoint had not
    seen, on the same weights, as the run that never stopped."""
    data = {"train": "s3://clicks/logs/*", "val": URLS[:1], "stream": True, "chunk_bytes": 600}
    full = _fit(data, tmp_path / "ckpt", epochs=2)
    assert len(full) == 22, "11 batches an epoch"
    resumed = _fit(data, tmp_path / "again", ckpt=next((tmp_path / "ckpt").glob("step=8*")), epochs=2)
    assert resumed == full[8:]


@pytest.mark.dist
def test_a_profile_s_credentials_and_endpoint_url_are_used(s3: SimpleNamespace, tmp_path: Path) -> None:
    """As the AWS CLI: ``AWS_PROFILE`` names a profile whose keys are in the credentials file and whose
    ``endpoint_url`` (an S3-compatible store) is in the config file; no variable holds either."""
    (tmp_path / "config").write_text(f"[profile local]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n")
    key, secret = s3.reader
    (tmp_path / "credentials").write_text(f"[local]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    files = {"AWS_CONFIG_FILE": str(tmp_path / "config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials")}
    with aws_env(None, None, None, AWS_PROFILE="local", **files):
        dm = TabularDataModule(schema=SCHEMA, train=URLS[1])
        dm.setup("fit")
    assert dm.row_counts["train"]["rows"] == 400


def _refusal(patterns: Any) -> str:
    with pytest.raises((FileNotFoundError, PermissionError)) as err:
        TabularDataModule(schema=SCHEMA, train=patterns).check()
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.dist
def test_each_cause_is_one_line_naming_the_url(s3: SimpleNamespace) -> None:
    with aws_env(s3.endpoint, *s3.reader):
        assert _refusal("s3://nosuch/logs/*.parquet") == (
            f"TabularDataModule: train: 's3://nosuch/logs/*.parquet': no such bucket 'nosuch' (S3 at {s3.endpoint})."
        )
        assert (
            _refusal("s3://clicks/logs/*.tsv") == "TabularDataModule: train: 's3://clicks/logs/*.tsv' matches no file."
        )
        assert _refusal("s3://clicks/old/") == "TabularDataModule: train: 's3://clicks/old/' does not exist."
        assert _refusal("s3://clicks/notes/") == (
            "TabularDataModule: train: 's3://clicks/notes/' matches 1 object(s) but none is a table (.parquet, .pq, "
            ".csv, .tsv, .txt, .csv.gz, .tsv.gz, .txt.gz), e.g. 's3://clicks/notes/notes.md'."
        )
    with aws_env(s3.endpoint, *s3.nobody):
        assert _refusal(URLS) == (
            "TabularDataModule: train: 's3://clicks/logs/a.parquet': access denied for AWS_ACCESS_KEY_ID from the "
            "environment (HeadObject: No response body). HINT: credentials that may read the bucket."
        )
        assert "access denied" in _refusal("s3://clicks/logs/*")
    no_credentials = (
        "TabularDataModule: train: 's3://clicks/logs/*': no AWS credentials found (HINT: set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with its credentials in ~/.aws/credentials, as for the AWS CLI)."
    )
    with aws_env(s3.endpoint, None, None):  # and no instance metadata: refused before any request
        assert _refusal("s3://clicks/logs/*") == no_credentials
    with aws_env(s3.endpoint, None, None, AWS_EC2_METADATA_DISABLED="false"):  # the request made, unsigned, refused
        assert _refusal("s3://clicks/logs/*") == no_credentials


@pytest.mark.dist  # the CLI in this process
def test_the_cli_refuses_a_bucket_it_may_not_read_in_one_line_and_exit_2(
    s3: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as pl
    import yaml

    from lightning_rec._cli import run

    monkeypatch.setattr(pl.Trainer, "fit", lambda *a, **k: pytest.fail("Trainer.fit ran: its ranks would start"))
    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "recshard", "logger": False},
        "model": {"class_path": "lightning_rec.models.DLRMModule"},
        "data": {
            "class_path": "lightning_rec.data.TabularDataModule",
            "init_args": {"schema": SCHEMA, "train": "s3://clicks/logs/*.parquet", "val": URLS[0]},
        },
    }
    (tmp_path / "s3.yaml").write_text(yaml.safe_dump(config))
    with aws_env(s3.endpoint, *s3.nobody), pytest.raises(SystemExit) as exit_:
        run(["fit", "--config", str(tmp_path / "s3.yaml")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].endswith(
        "error: TabularDataModule: train: 's3://clicks/logs/*.parquet': access denied for AWS_ACCESS_KEY_ID from the "
        "environment (ListObjectsV2: Access Denied). HINT: credentials that may read the bucket."
    )


@pytest.mark.dist  # a GCS emulator process
def test_gs_urls_read_through_the_same_layer_give_the_rows_from_disk(tmp_path: Path) -> None:
    """``gs://`` through pyarrow's GCS filesystem (a local emulator, as ``STORAGE_EMULATOR_HOST`` names it): in
    memory and streamed, the rows of the same files on disk; a bucket that is not there, named. (Not the gzip file:
    the emulator serves a ``.gz`` object's ranges gzipped again, which Google's service does not.)"""
    files = _files(tmp_path)[:2]
    with LocalGCS() as gcs:
        gcs.upload("logs", {f"day-1/{Path(f).name}": f for f in files})
        remote = TabularDataModule(schema=SCHEMA, files="gs://logs/day-1/*", split=SPLIT)
        local = TabularDataModule(schema=SCHEMA, files=files, split=SPLIT)
        for dm in (remote, local):
            dm.setup("fit")
        r, d = remote.split("train"), local.split("train")
        _same(r[torch.arange(len(r))], d[torch.arange(len(d))])
        kw: dict[str, Any] = dict(schema=SCHEMA, stream=True, chunk_bytes=600, batch_size=64)
        streamed = list(_loader(TabularDataModule(train="gs://logs/day-1/", **kw), 0, 1))
        for a, b in zip(streamed, list(_loader(TabularDataModule(train=files, **kw), 0, 1)), strict=True):
            _same(a, b)
        with pytest.raises(FileNotFoundError) as err:
            TabularDataModule(schema=SCHEMA, train="gs://nosuch/day-1/*.csv").check()
    assert str(err.value) == (
        "TabularDataModule: train: 'gs://nosuch/day-1/*.csv': no such bucket 'nosuch' (Google Cloud Storage)."
    )


# ---- without a server (the fast tier) -----------------------------------------------------------------------------
def test_the_s3_endpoint_is_found_where_the_aws_cli_finds_it(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(
        "[profile plain]\nendpoint_url = http://profile:9000\n"
        "[profile svc]\nendpoint_url = http://profile:9000\nservices = local\n"
        "[services local]\ns3 =\n  endpoint_url = http://service:9000\n"
    )
    with aws_env(None, None, None, AWS_CONFIG_FILE=str(config)):
        assert filesystems.s3_endpoint() is None, "AWS's own endpoint"
        os.environ["AWS_PROFILE"] = "plain"
        assert filesystems.s3_endpoint() == "http://profile:9000"
        os.environ["AWS_PROFILE"] = "svc"
        assert filesystems.s3_endpoint() == "http://service:9000", "the services section before the profile's own"
        os.environ["AWS_ENDPOINT_URL"] = "http://env:1"
        assert filesystems.s3_endpoint() == "http://env:1", "the environment before the files"
        os.environ["AWS_ENDPOINT_URL_S3"] = "http://env-s3:2"
        assert filesystems.s3_endpoint() == "http://env-s3:2", "S3's own variable first"
        os.environ["AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"] = "true"
        assert filesystems.s3_endpoint() is None


def test_credentials_are_found_where_the_aws_tools_find_them(tmp_path: Path) -> None:
    (tmp_path / "credentials").write_text("[team]\naws_access_key_id = A\naws_secret_access_key = B\n")
    (tmp_path / "config").write_text("[profile sso]\nsso_session = corp\n")
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "config")}
    with aws_env(None, None, None, **files):
        assert filesystems.s3_credentials() is None
        os.environ["AWS_PROFILE"] = "team"
        assert filesystems.s3_credentials() == "profile 'team'"
        os.environ["AWS_PROFILE"] = "sso"
        assert filesystems.s3_credentials() == "profile 'sso'"
    with aws_env(None, "key", "secret"):
        assert filesystems.s3_credentials() == "AWS_ACCESS_KEY_ID from the environment"


def test_an_az_url_without_its_storage_account_is_refused_naming_the_variable() -> None:
    saved = os.environ.pop("AZURE_STORAGE_ACCOUNT_NAME", None)
    try:
        with pytest.raises(PermissionError) as err:
            TabularDataModule(schema=SCHEMA, train="az://logs/clicks/*.parquet").check()
    finally:
        if saved is not None:
            os.environ["AZURE_STORAGE_ACCOUNT_NAME"] = saved
    assert str(err.value) == (
        "TabularDataModule: train: 'az://logs/clicks/*.parquet': az:// URLs name a container, not its storage "
        "account: set AZURE_STORAGE_ACCOUNT_NAME (and AZURE_STORAGE_ACCOUNT_KEY, or sign in as Azure's tools do: "
        "`az login`, a managed identity)."
    )


def test_a_url_of_a_scheme_not_read_is_refused_naming_those_read() -> None:
    with pytest.raises(FileNotFoundError) as err:
        TabularDataModule(schema=SCHEMA, train="https://example.com/clicks.parquet").check()
    assert str(err.value) == (
        "TabularDataModule: train: 'https://example.com/clicks.parquet': https:// URLs are not read; a path, a glob, "
        "a directory, a file:// URL or object storage (s3://, gs://, gcs://, az://) is."
    )


def test_a_glob_matches_within_one_path_segment_as_on_disk(tmp_path: Path) -> None:
    """The same patterns over a local folder (glob) and the same keys (the listing's match): the same files."""
    for name in ("2026/01/a.csv", "2026/02/b.csv", "2026/02/c.parquet", "2026/x.csv", "2025/01/d.csv"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("click\n1\n")
    listed = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]

    class Listing:  # what a bucket's listing gives, for expand_url's matching
        def get_file_info(self, what: Any) -> Any:
            import pyarrow.fs as pafs

            if isinstance(what, str):
                return pafs.FileInfo(what, pafs.FileType.Directory)
            base = what.base_dir.split("/", 1)[1] if "/" in what.base_dir else ""
            under = [k for k in listed if k.startswith(base + "/" if base else "")]
            if not what.recursive:
                under = [k for k in under if "/" not in k[len(base) + 1 if base else 0 :]]
            return [pafs.FileInfo(f"bkt/{k}", pafs.FileType.File) for k in under]

    for pattern in ("2026/*/*.csv", "2026/0[2]/*", "*/01/*.csv", "2026/*.csv", "20*/*/[ab].*"):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(filesystems, "_resolve", lambda url, what: (Listing(), url.split("://", 1)[1].rstrip("/")))
            m.setattr(filesystems, "_check_s3_credentials", lambda url, what: None)
            got = filesystems.expand_url(f"s3://bkt/{pattern}", "train", (".csv", ".parquet"))
        expected = sorted(f"s3://bkt/{Path(p).relative_to(tmp_path).as_posix()}" for p in tmp_path.glob(pattern))
        assert got == expected, pattern


def test_a_remote_file_is_read_in_few_requests(tmp_path: Path) -> None:
    """Each read of a remote file is a request: read to its end, it is one (not one per 8 KiB, Python's default);
    read line by line, one per 64 KiB."""
    import pyarrow as pa

    data = b"".join(b"%d,%d\n" % (i, i * i) for i in range(100_000))  # ~1.2 MB

    class Counted:  # a pyarrow file that counts its reads (a remote file's requests)
        def __init__(self) -> None:
            self.file, self.reads = pa.BufferReader(data), 0

        def read(self, n: int | None = None) -> bytes:
            self.reads += 1
            return bytes(self.file.read(n))

        def seek(self, offset: int, whence: int = 0) -> int:
            return int(self.file.seek(offset, whence))

        def tell(self) -> int:
            return int(self.file.tell())

        def close(self) -> None:
            self.file.close()

    native = Counted()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(filesystems, "open_native", lambda path, what="file": native)
        with filesystems.open_file("s3://bkt/squares.csv") as f:
            assert f.read() == data
        assert native.reads <= 2, "the buffer's first fill, then the rest at once"
        native = Counted()
        with filesystems.open_file("s3://bkt/squares.csv") as f:
            f.seek(600_000)
            f.readline()
            assert f.read(500_000) == data[f.tell() - 500_000 : f.tell()]
        assert native.reads <= 3
