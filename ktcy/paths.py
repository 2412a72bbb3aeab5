"""Untrusted paths and small files: `~` expansion, Hugging Face hub ids resolved in the local
cache (never downloaded), shard names confined to their checkpoint folder, and JSON read only
from regular files of bounded size (a FIFO or /dev/zero named config.json must fail at once)."""
import os
import re
import stat

from ktcy.safetensors_io import CheckpointError, open_regular_file, strict_json

# config.json of real models is a few kB; the largest known indexes (~100k tensors) are ~10 MB.
MAX_CONFIG_BYTES = 4 * 2**20
MAX_INDEX_BYTES = 64 * 2**20

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def as_path(path, what="path"):
    """A str path with `~` expanded (TypeError for anything that is not a path)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{what} must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if "\0" in path:
        raise ValueError(f"{what} contains a NUL byte")
    return os.path.expanduser(path)


def hub_cache_dir():
    """Where huggingface_hub keeps its cache: HF_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.join(os.path.expanduser(base), "huggingface", "hub")


def looks_like_hub_id(path):
    return bool(_HUB_ID.fullmatch(path)) and ".." not in path


def resolve_model_path(path, what="path"):
    """The folder `path` names: `~` expanded; a hub id such as "Qwen/Qwen3-30B-A3B" that is not
    an existing path is looked up in the local Hugging Face cache (snapshot named by refs/main).
    Nothing is downloaded: a missing id is a CheckpointError with the command that fetches it."""
    path = as_path(path, what)
    if os.path.exists(path) or not looks_like_hub_id(path):
        return path
    snapshot = _cached_snapshot(path)
    if snapshot is None:
        raise CheckpointError(f"{path}: no such folder, and the Hugging Face model {path} was not found locally in "
                              f"{hub_cache_dir()}; download it with `huggingface-cli download {path}` or pass a folder")
    return snapshot


def _cached_snapshot(repo_id):
    repo = os.path.join(hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    ref = os.path.join(repo, "refs", "main")
    if os.path.exists(ref):
        revision = read_small_text(ref, 256).strip()
        # refs/main comes from disk: accept a plain revision name, never a path
        if not _REVISION.fullmatch(revision):
            raise CheckpointError(f"{ref}: not a revision name ({revision[:60]!r})")
        folder = os.path.join(snapshots, revision)
        if not os.path.isdir(folder):
            raise CheckpointError(f"{ref} names revision {revision}, but {folder} is missing "
                                  f"(an interrupted download?); download it again with `huggingface-cli download {repo_id}`")
        return folder
    revisions = sorted(n for n in os.listdir(snapshots) if os.path.isdir(os.path.join(snapshots, n)))
    if len(revisions) == 1:
        return os.path.join(snapshots, revisions[0])
    if not revisions:
        return None
    raise CheckpointError(f"{repo}: several cached revisions ({', '.join(revisions[:5])}) and no refs/main; "
                          f"pass the folder {snapshots}/<revision>")


def allowed_roots(folder):
    """Real folders a checkpoint's files may live in: the folder itself, and for a snapshot of the
    Hugging Face cache its repository's blobs folder (snapshot files are symlinks into it)."""
    real = os.path.realpath(folder)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots" and os.path.basename(os.path.dirname(parent)).startswith("models--"):
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def confined_file(folder, name, roots, what, noun="shard"):
    """folder/name for a file name read from disk (an index's shard names, or a listing): a
    relative name without `..` whose real path stays under one of `roots`."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{what}: {noun} name {name!r} is not a file name")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts:
        raise CheckpointError(f"{what}: {noun} name {name!r} points outside the checkpoint folder {folder}")
    full = os.path.join(folder, name)
    real = os.path.realpath(full)
    if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
        raise CheckpointError(f"{what}: {noun} {name!r} resolves to {real}, outside the checkpoint folder {folder} "
                              "(a symlink out of the folder is refused)")
    return full


def read_small_text(path, max_bytes, what=None):
    """The UTF-8 text of a regular file no larger than max_bytes (CheckpointError otherwise)."""
    what = what or path
    fd = open_regular_file(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise CheckpointError(f"{what}: {size} bytes, more than the {max_bytes} this file may have")
        chunks, total = [], 0
        while total <= max_bytes:  # the size may change after fstat: never read past the cap
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > max_bytes:
        raise CheckpointError(f"{what}: more than the {max_bytes} bytes this file may have")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what}: not UTF-8 text ({e})") from None


def read_json(path, max_bytes, what=None):
    """A JSON document from a regular file of at most max_bytes; duplicate keys are refused
    (which one a reader keeps is undefined, so the file is ambiguous)."""
    what = what or path
    return strict_json(read_small_text(path, max_bytes, what), what, "the file")


def require_folder(path, what="checkpoint"):
    """CheckpointError unless path is an existing folder."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.fspath(path).endswith(".gguf"):
            raise CheckpointError(f"{path}: no such file") from None
        raise CheckpointError(f"{path}: not a folder (nothing exists there); a {what} is a folder holding "
                              "config.json and .safetensors files") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    if not stat.S_ISDIR(mode):
        hint = ("; a GGUF model's MoE blocks load with ktcy.load_experts, ktcy.MoEModel or ktcy convert, and "
                "ktcy.hf takes the file as gguf_path= beside a folder holding its config.json") if os.fspath(path).endswith(".gguf") else ""
        raise CheckpointError(f"{path}: not a folder (a {what} is a folder holding config.json and .safetensors files)"
                              + hint)
