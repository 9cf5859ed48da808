"""Safetensors checkpoints on disk, indexed by what their tensors hold: the sha256 of each tensor's bytes as the file
stores them, which is what a program names a weight by (gpunet.job.format.WeightRef, docs/weights.md).

A worker indexes its ``--models-dir`` folders with it (the weights it may load without anyone uploading them), a
client the checkpoint folder it serves (which of a traced span's weights the volunteers may hold already). Hashing a
file once costs a pass over it (about a second per GB); the result is kept in a small JSON file beside the node's
data, keyed by each file's path, size and modification time, so a restart re-hashes only what changed.

Nothing outside a folder is read: files are found without following symlinked directories, and a symlinked file is
taken only when its target lies inside the same folder (a Hugging Face cache links snapshots to blobs that way).
Headers are bounded and checked like any safetensors bytes from the network: a volunteer's folder may hold anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from gpunet.job import tensors

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
#: The index file's format; a cache of another version is ignored (rebuilt).
INDEX_VERSION = 1
#: In a slim checkpoint folder (``gpunet checkpoint slim``): every tensor of the whole checkpoint, by name, hash,
#: dtype and shape, for a client that holds only the ends it runs itself.
WEIGHTS_LIST = "gpunet-weights.json"
WEIGHTS_LIST_VERSION = 1
#: The most bytes of a weights list read (a 70B model's is a few hundred KB).
MAX_WEIGHTS_LIST_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes lie: a file (its real path), the byte range, and what the file says they are."""

    path: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    name: str


def tensor_sha256(data) -> str:
    """The content hash of a tensor's stored bytes (what WeightRef.sha256 names)."""
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def read_header(path: str | Path) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """The tensors a safetensors file declares: (name, dtype, shape, absolute offset, length), checked against the
    file's size the way tensors.decode checks bytes from the network. ValueError when it is not one gpunet reads."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > tensors.MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"header length {n} is over the limit or past the end")
        head = f.read(n)
    try:
        plan = tensors._plan.__wrapped__(head, size - 8 - n)
    except Exception as e:  # JobRejected: the reason says what
        raise ValueError(str(e)) from None
    return [(name, tensors.DTYPE_NAMES[dtype], shape, 8 + n + begin, end - begin)
            for begin, end, name, dtype, shape in plan.specs]


def checkpoint_id(hashes: Iterable[str]) -> str:
    """One name for a whole checkpoint: the sha256 of its tensors' hashes, sorted (the same tensors, however the
    files are split or named, are the same checkpoint), cut to 128 bits (32 hex digits). It only steers routing and
    names holders, which are checked tensor by tensor against full hashes, and short ids keep worker records small."""
    h = hashlib.sha256(b"gpunet-checkpoint-v1\0")
    for digest in sorted(set(hashes)):
        h.update(bytes.fromhex(digest))
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class ListedTensor:
    """A tensor of a checkpoint as a weights list names it (its bytes may be nowhere on this machine)."""

    name: str
    sha256: str
    dtype: str
    shape: tuple[int, ...]


def write_weights_list(folder: str | Path, index: "CheckpointIndex") -> Path:
    """The weights list of the checkpoint ``index`` holds (one folder), written into ``folder``."""
    listed = [[name, sha, loc.dtype, list(loc.shape)] for name, (sha, loc) in sorted(index.named().items())]
    path = Path(folder) / WEIGHTS_LIST
    path.write_text(json.dumps({"version": WEIGHTS_LIST_VERSION, "checkpoint": checkpoint_id(t[1] for t in listed),
                                "tensors": listed}, indent=0) + "\n")
    return path


def read_weights_list(folder: str | Path) -> dict[str, ListedTensor] | None:
    """A folder's weights list by tensor name (None: it has none). ValueError, saying what, when it is malformed or
    its checkpoint id does not match its hashes."""
    path = Path(folder) / WEIGHTS_LIST
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_WEIGHTS_LIST_BYTES:
        raise ValueError(f"{path} is over {MAX_WEIGHTS_LIST_BYTES} bytes")
    try:
        obj = json.loads(path.read_text())
        if not isinstance(obj, dict) or obj.get("version") != WEIGHTS_LIST_VERSION:
            raise ValueError(f"version {obj.get('version') if isinstance(obj, dict) else None!r}, not "
                             f"{WEIGHTS_LIST_VERSION}")
        out: dict[str, ListedTensor] = {}
        for name, sha, dtype, shape in obj["tensors"]:
            if not (isinstance(name, str) and isinstance(sha, str) and len(sha) == 64
                    and all(c in "0123456789abcdef" for c in sha) and dtype in tensors.DTYPES
                    and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                raise ValueError(f"a malformed entry for {str(name)[:80]!r}")
            if name in out:
                raise ValueError(f"{name!r} is listed twice")
            out[name] = ListedTensor(name, sha, dtype, tuple(shape))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a weights list: {type(e).__name__}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{path} is not a weights list: {e}") from None
    if obj.get("checkpoint") != checkpoint_id(t.sha256 for t in out.values()):
        raise ValueError(f"{path} names checkpoint {str(obj.get('checkpoint'))[:40]!r}, but its hashes make "
                         f"{checkpoint_id(t.sha256 for t in out.values())}")
    return out


class CheckpointIndex:
    """Every tensor of the ``.safetensors`` files under some folders, by content hash."""

    def __init__(self, roots: Iterable[str | Path], cache: str | Path | None = None,
                 files: Iterable[str] | None = None):
        """``roots``: the folders; ``cache``: the JSON file that keeps the hashes between runs (None: none kept);
        ``files``: only these file names at the top of each root (a model's own files, as transformers loads them:
        not a training run's checkpoint-500/ beside them), instead of every safetensors file beneath it."""
        self.roots = [Path(r).resolve() for r in roots]
        self.cache = Path(cache) if cache is not None else None
        self.only = None if files is None else set(files)
        self._by_hash: dict[str, TensorLocation] = {}
        self._files: dict[str, dict] = {}  # real path -> {"size", "mtime_ns", "folder", "tensors": [[sha, name, ...]]}
        self.skipped: list[str] = []  # what was not indexed, and why (symlinks out, unreadable files)

    # --- building ---------------------------------------------------------------------------------------------------

    def scan(self) -> "CheckpointIndex":
        """(Re-)index: files whose size and modification time match the cache keep their hashes; the rest are hashed
        now. Returns self."""
        known = self._load_cache()
        files, skipped = {}, []
        for root in self.roots:
            for path, folder in self._files_under(root, skipped, self.only):
                try:
                    st = os.stat(path)
                    entry = known.get(path)
                    if not _well_formed(entry) or entry["size"] != st.st_size or entry["mtime_ns"] != st.st_mtime_ns:
                        entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "tensors": _hash_file(path)}
                    # A checkpoint is the folder its files are listed in (a snapshot's, for a linked blob).
                    files[path] = {**entry, "folder": folder}
                except (OSError, ValueError) as e:
                    skipped.append(f"{path}: {e}")
        self._files, self.skipped = files, skipped
        for line in skipped:
            logger.warning("Models dir: not indexed: %s", line)
        self._rebuild()
        self._save_cache()
        return self

    @staticmethod
    def _files_under(root: Path, skipped: list[str], only: set[str] | None = None) -> list[str]:
        if not root.is_dir():
            skipped.append(f"{root}: not a folder")
            return []
        found = []
        for folder, dirs, names in os.walk(root, followlinks=False):
            if only is not None:
                dirs.clear()  # the top only
            for name in sorted(names):
                if not name.endswith(SUFFIX) or (only is not None and name not in only):
                    continue
                path = os.path.join(folder, name)
                real = os.path.realpath(path)
                if os.path.commonpath([real, str(root)]) != str(root):
                    skipped.append(f"{path}: a symlink out of {root} (not followed)")
                    continue
                if os.path.isfile(real):
                    found.append((real, folder))
        return sorted(set(found))

    def _rebuild(self) -> None:
        self._by_hash = {}
        for path, entry in self._files.items():
            for sha, name, offset, length, dtype, shape in entry["tensors"]:
                self._by_hash.setdefault(sha, TensorLocation(path, offset, length, dtype, tuple(shape), name))

    def _load_cache(self) -> dict:
        if self.cache is None:
            return {}
        try:
            obj = json.loads(self.cache.read_text())
            return obj["files"] if obj.get("version") == INDEX_VERSION and isinstance(obj.get("files"), dict) else {}
        except (OSError, ValueError, KeyError, AttributeError):
            return {}

    def _save_cache(self) -> None:
        if self.cache is None:
            return
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"version": INDEX_VERSION, "files": {
            p: {k: v for k, v in e.items() if k != "folder"} for p, e in self._files.items()}})
        fd, tmp = tempfile.mkstemp(dir=self.cache.parent, prefix=".tmp-index-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, self.cache)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # --- reading ----------------------------------------------------------------------------------------------------

    def __contains__(self, sha: str) -> bool:
        return sha in self._by_hash

    def __len__(self) -> int:
        return len(self._by_hash)

    def find(self, sha: str) -> TensorLocation | None:
        """Where the tensor with this content hash lies, if anywhere here (as of the last scan: its bytes are checked
        against the hash when they load)."""
        return self._by_hash.get(sha)

    def forget(self, sha: str) -> str | None:
        """Stop offering a tensor whose bytes no longer match (a damaged or changed file): its file is re-hashed at
        the next scan. Returns that file's path."""
        loc = self._by_hash.pop(sha, None)
        if loc is None:
            return None
        entry = self._files.get(loc.path)
        if entry is not None:
            entry["mtime_ns"] = -1  # re-hashed at the next scan, whatever its time says (kept so across restarts)
            try:
                self._save_cache()
            except OSError as e:
                logger.warning("Models dir: could not note %s as damaged in %s: %s", loc.path, self.cache, e)
        return loc.path

    def read(self, sha: str) -> memoryview | None:
        """The bytes the index says hold this tensor (not checked here), mapped read-only; None if it has none or the
        file is gone."""
        loc = self._by_hash.get(sha)
        if loc is None:
            return None
        try:
            with open(loc.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        if loc.offset + loc.length > len(mapped):
            return None
        return memoryview(mapped)[loc.offset:loc.offset + loc.length]

    def named(self) -> dict[str, tuple[str, TensorLocation]]:
        """Every tensor by the name its file gives it: (sha256, where). For one checkpoint folder, whose names are
        unique; a name found twice keeps its first file, in path order."""
        out: dict[str, tuple[str, TensorLocation]] = {}
        for path in sorted(self._files):
            for sha, name, offset, length, dtype, shape in self._files[path]["tensors"]:
                out.setdefault(name, (sha, TensorLocation(path, offset, length, dtype, tuple(shape), name)))
        return out

    @property
    def id(self) -> str:
        """The checkpoint id of everything indexed (for one checkpoint folder: that checkpoint's, as a worker that
        keeps the same files names it)."""
        return checkpoint_id(self._by_hash)

    @property
    def total_bytes(self) -> int:
        return sum(e["size"] for e in self._files.values())

    def checkpoints(self) -> dict[str, dict]:
        """Each folder that holds safetensors files, as one checkpoint: its id (checkpoint_id of its tensors), size,
        tensor count, and whether every tensor is still offered (one forgotten as damaged: not held in full); by
        folder path."""
        by_folder: dict[str, list] = {}
        for entry in self._files.values():
            by_folder.setdefault(entry["folder"], []).append(entry)
        out = {}
        for folder, entries in sorted(by_folder.items()):
            hashes = [t[0] for e in entries for t in e["tensors"]]
            out[folder] = {"id": checkpoint_id(hashes), "bytes": sum(e["size"] for e in entries),
                           "tensors": len(hashes), "complete": all(h in self._by_hash for h in hashes)}
        return out


def _well_formed(entry) -> bool:
    """A cached file entry this version can use (anything else in the cache file is hashed again)."""
    try:
        return (isinstance(entry, dict) and type(entry["size"]) is int and type(entry["mtime_ns"]) is int
                and all(len(t) == 6 and isinstance(t[0], str) and len(t[0]) == 64 and isinstance(t[1], str)
                        and type(t[2]) is int and type(t[3]) is int and t[4] in tensors.DTYPES
                        and all(type(d) is int for d in t[5]) for t in entry["tensors"]))
    except (KeyError, TypeError):
        return False


#: How much of a file is read at a time while hashing it.
_HASH_CHUNK = 8 * 2**20


def _hash_file(path: str) -> list[list]:
    """[sha256, name, offset, length, dtype, shape] of every tensor in a safetensors file."""
    out = []
    header = read_header(path)
    if not header:
        return out
    # Read through one buffer, not mapped: a mapping's pages count as the process's memory until it is closed, so
    # hashing a 600 MB file that way grew a client's peak memory by 600 MB.
    buffer = memoryview(bytearray(_HASH_CHUNK))
    with open(path, "rb", buffering=0) as f:
        for name, dtype, shape, offset, length in header:
            hasher, done = hashlib.sha256(), 0
            f.seek(offset)
            while done < length:
                n = f.readinto(buffer[:min(_HASH_CHUNK, length - done)])
                if not n:
                    raise ValueError(f"{name} ends past the end of the file")
                hasher.update(buffer[:n])
                done += n
            out.append([hasher.hexdigest(), name, offset, length, dtype, list(shape)])
    return out



class StandIns:
    """Tensors that stand for a checkpoint's tensors without holding their bytes, for tracing a model whose weights
    stay on disk (a client tracing a 70B model's decoder layers needs their shapes, not their 140 GB): fake tensors
    (torch's FakeTensor, CPU as far as tracing can tell), each remembered with the :class:`WeightRef` of the file
    tensor it stands for. :meth:`gpunet.Job.from_module` names such a weight by reference; its bytes are read from
    the index when a worker or a local check asks for them."""

    def __init__(self, index: CheckpointIndex, checkpoint: str | None = None):
        """``checkpoint``: the id of the checkpoint the stand-ins are from (by default, the index's)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.index = index
        self.checkpoint = checkpoint or index.id
        # Real tensors (the ends' weights, rotary tables, inputs) meet stand-ins in one computation while tracing.
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._refs: dict[int, tuple[object, object]] = {}  # id(stand-in) -> (stand-in, WeightRef)

    def make(self, t: ListedTensor, parameter: bool = True):
        """A stand-in for the checkpoint's tensor ``t``: a module's parameter, or a buffer."""
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        from gpunet.job.format import WeightRef

        meta = torch.empty(t.shape, dtype=tensors.DTYPES[t.dtype], device="meta")
        fake = FakeTensor(self.mode, meta, torch.device("cpu"))
        if parameter:  # (a Parameter of a tensor subclass is a new object: the one kept is the one the module holds)
            fake = torch.nn.Parameter(fake, requires_grad=False)
        self._refs[id(fake)] = (fake, WeightRef(t.name, t.sha256, t.dtype, t.shape))
        return fake

    def ref_of(self, t) -> "object | None":
        """The WeightRef a tensor stands for (named after the file's tensor; the program renames it), or None."""
        found = self._refs.get(id(t))
        return found[1] if found is not None and found[0] is t else None

    def names(self) -> set[str]:
        """The file names of the tensors stood in for."""
        return {ref.name for _, ref in self._refs.values()}

    def is_stand_in(self, t) -> bool:
        """Whether ``t`` was made by these stand-ins (a tensor computed from them included)."""
        return getattr(t, "fake_mode", None) is self.mode

    def read(self, sha: str) -> memoryview | None:
        """A stood-in tensor's bytes from the files (None: this machine holds only its hash)."""
        return self.index.read(sha)

