"""The sharded part of a checkpoint (``train.parallelism=fsdp``): ``torch.distributed.checkpoint`` (DCP) files under
``sharded/`` of the checkpoint directory, in place of ``model.pth`` and AdamW's part of ``train_state.pt``::

    sharded/.metadata         rank 0's, written once every rank has written its shards: which slice of which tensor
                              lies where (the model and AdamW, keyed by parameter name: ``model.<key>``,
                              ``optimizer.state.<key>.exp_avg``, ...)
    sharded/__<r>_0.distcp    rank r's slices

Each rank writes into its own staging directory and Ray Train uploads them all into the same checkpoint directory,
as it does ``rng/``. Every file's size goes into COMPLETE.json (the ranks tell rank 0 theirs), so a checkpoint with a
shard missing or cut short is refused like any other. Reads go through pyarrow.fs (a local directory, ``s3://``,
``gs://``) and any number of ranks reads any other number's shards: DCP cuts each rank's slices out of what was
written (resharding), and a process with no process group reads whole tensors (export, eval, a DDP run's restore).

DCP's ``.metadata`` is a pickle; it is read with an unpickler that admits DCP's own record classes and torch's
dtypes and sizes only, so a checkpoint cannot run code, as ``torch.load(weights_only=True)`` guarantees for the rest.
(Writing is DCP's own FileSystemWriter, into the local staging directory.)
"""
from __future__ import annotations

import contextlib
import functools
import io
import pickle
import warnings
from pathlib import Path
from typing import Any, Dict

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

SHARDED_DIR = "sharded"
METADATA = f"{SHARDED_DIR}/.metadata"
MODEL_PREFIX = "model."  # the model's keys inside the sharded state ({"model": ..., "optimizer": ...}, flattened)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def _one_process_on_purpose():
    """DCP warns on every call made without a process group; here that is chosen, not an accident."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def write_sharded(ckpt_dir, state: Dict[str, Any]) -> Dict[str, int]:
    """Every rank, together (a collective): its slices of ``state`` into ``ckpt_dir/sharded``. Returns every rank's
    files with their sizes, relative to ``ckpt_dir`` (COMPLETE.json lists them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    out = Path(ckpt_dir) / SHARDED_DIR
    with _one_process_on_purpose():
        dcp.save(state, storage_writer=FileSystemWriter(str(out)), no_dist=not _distributed())
    mine = {f"{SHARDED_DIR}/{p.name}": p.stat().st_size for p in sorted(out.iterdir())
            if p.is_file() and not p.name.endswith(".tmp")}
    if not _distributed():
        return mine
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: size for files in everyone for name, size in files.items()}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's record classes, torch's dtypes/sizes and plain containers; anything else is refused."""

    SAFE = {("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # the path it was written to
            ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in self.SAFE or (
                module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                              torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


@functools.lru_cache(maxsize=None)
def _reader_class():
    """DCP's FileSystemReader over a pyarrow filesystem, with the metadata read by :class:`_MetadataUnpickler`. Built
    on first use: importing torch.distributed.checkpoint takes seconds, which nothing that only lists checkpoints
    should pay."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class _ArrowFileSystem(FileSystemBase):
        """DCP's file access (reading) over a pyarrow filesystem."""

        def __init__(self, fs: pafs.FileSystem):
            self.fs = fs

        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if mode != "rb":
                raise ValueError(f"{path}: a stored checkpoint is read, never written in place (mode {mode!r})")
            with self.fs.open_input_file(str(path)) as f:
                yield f

        def concat_path(self, path, suffix: str) -> str:
            return f"{str(path).rstrip('/')}/{suffix}"

        def init_path(self, path) -> str:
            return str(path)

        def exists(self, path) -> bool:
            return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

        def rename(self, path, new_path) -> None:
            raise NotImplementedError("read only")

        def mkdir(self, path) -> None:
            raise NotImplementedError("read only")

        def rm_file(self, path) -> None:
            raise NotImplementedError("read only")

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            return False

    class ShardedReader(FileSystemReader):
        """DCP's reader on the ``sharded/`` directory of a checkpoint on ``fs`` (any pyarrow filesystem)."""

        def __init__(self, fs: pafs.FileSystem, ckpt_path: str):
            super().__init__(f"{ckpt_path.rstrip('/')}/{SHARDED_DIR}")
            self.fs = _ArrowFileSystem(fs)
            self.path = f"{ckpt_path.rstrip('/')}/{SHARDED_DIR}"

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return ShardedReader


def load_sharded(fs: pafs.FileSystem, ckpt_path: str, state: Dict[str, Any]) -> None:
    """Fill ``state`` (the shape of what was saved, each tensor this process's slice, or whole) from the checkpoint;
    with a process group of more than one rank, every rank calls it together."""
    import torch.distributed.checkpoint as dcp

    with _one_process_on_purpose():
        dcp.load(state, storage_reader=_reader_class()(fs, ckpt_path), no_dist=not _distributed())


def read_whole_model(fs: pafs.FileSystem, ckpt_path: str) -> Dict[str, torch.Tensor]:
    """The model's weights as whole CPU tensors under MiniMind's keys, by this process alone (no collective, no
    model needed: the shapes come from the metadata)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader_class()(fs, ckpt_path)
    items = reader.read_metadata().state_dict_metadata
    model = {k[len(MODEL_PREFIX):]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in items.items()
             if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}
    with _one_process_on_purpose():
        dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return model
