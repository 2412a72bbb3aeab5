"""Safety of the converters' output folder: an exclusive lock per folder, refusal to write into
an input, writes under unique temporary names that leave nothing behind when they fail, and a
fingerprint of the source checkpoint so that --resume can tell whether files on disk came from
the same source."""
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import struct

from ktcy.gguf_io import GGUFFile, split_parts
from ktcy.safetensors_io import write

LOCK_NAME = ".ktcy_convert.lock"
_PID_LINE = re.compile(rb"(?:[0-9]{1,20}\n?)?")  # what a lock file holds: empty (new) or a pid
_MAX_HEADER = 100 * 1024 * 1024


class ConvertError(ValueError):
    """A conversion that cannot or must not go ahead (a user error, or a write that failed)."""


def refuse_output_in_input(input_path, output_path, output_flag="--output"):
    """ConvertError when the output folder is the input folder or lies inside it (symlinks
    resolved), so that no converter ever writes into a checkpoint it reads."""
    src, dst = os.path.realpath(input_path), os.path.realpath(output_path)
    if dst == src or dst.startswith(src.rstrip(os.sep) + os.sep):
        raise ConvertError(f"{output_flag} {output_path} is {'the input folder' if dst == src else 'inside the input folder'}"
                           f" {input_path}; converters never write into their input - choose another folder")


class OutputLock:
    """Exclusive flock on <folder>/.ktcy_convert.lock for the whole conversion.  A second
    converter on the same folder fails at once with a clear error instead of waiting: it would
    otherwise go on to write the same files, possibly in another format, once the first ends.
    The lock file stays in place (removing it would let two processes lock different inodes)."""

    def __init__(self, folder):
        self.folder, self.fd = os.fspath(folder), None

    def __enter__(self):
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise ConvertError(f"output {self.folder} exists and is not a folder")
        if os.path.islink(self.folder) and not os.path.exists(self.folder):
            raise ConvertError(f"output {self.folder} is a symbolic link to {os.readlink(self.folder)}, which does not "
                               "exist; create that folder or choose another output")
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise ConvertError(f"cannot create the output folder {self.folder} ({e.strerror})") from None
        self.fd = _open_lock_file(os.path.join(self.folder, LOCK_NAME))
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            self.fd = None
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConvertError(f"another converter (pid {holder}) is writing to {self.folder}; wait for it to "
                                   "finish or choose another output folder") from None
            raise ConvertError(f"cannot lock {self.folder} ({e.strerror})") from None
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
            _remove_dead_temporaries(self.folder)
        except BaseException as e:  # __exit__ will not run: the lock must not stay held
            self.__exit__()
            if isinstance(e, OSError):
                raise ConvertError(f"cannot write the lock file {os.path.join(self.folder, LOCK_NAME)} "
                                   f"({e.strerror or e})") from None
            raise
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
        return False


def _open_lock_file(path):
    """The lock file opened for writing, only if it is ours to write: never through a symlink, and
    never a FIFO, device or a file holding anything but a converter's pid (the lock's pid is
    rewritten, so a foreign file of that name would be destroyed).  A hard-linked pid file (a
    folder copied with `cp -al`) is still a lock file: its other names lock with it."""
    try:
        # 0o666 less the umask, as files are made: a group sharing the folder (umask 002) can lock it too
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        why = "it is a symlink" if e.errno == errno.ELOOP else e.strerror
        raise ConvertError(f"cannot open the lock file {path} ({why}); ktcy writes only a lock file it can own - "
                           "remove it or choose another output folder") from None
    st = os.fstat(fd)
    content = os.pread(fd, 33, 0) if stat.S_ISREG(st.st_mode) else b""
    if not stat.S_ISREG(st.st_mode) or not _PID_LINE.fullmatch(content):
        os.close(fd)
        raise ConvertError(f"{path} is not a ktcy lock file (a converter's pid); ktcy does not overwrite it - "
                           "remove it or choose another output folder")
    return fd


_TEMPORARY_PREFIX = ".ktcy-tmp."


def _temporary_name(final):
    folder, name = os.path.split(os.fspath(final))
    return os.path.join(folder, f"{_TEMPORARY_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


# publish()'s temporaries (and write()'s .partial): ktcy's prefix, whatever file they were to
# become (the FP8 export copies tokenizer files too), or, as ktcy named them before that prefix,
# a converter's own file names; a name merely shaped like one (.notes.2024.deadbeef.tmp) stays
_TEMPORARY = re.compile(r"(?:\.ktcy-tmp\.[^/]+|\.(?:ktcy_layer_[0-9]{4,9}\.safetensors|ktcy_model\.json"
                        r"|ktcy_fp8_export\.json|config\.json|model\.safetensors\.index\.json"
                        r"|model-fp8-layer[0-9]{4,9}\.safetensors|model-rest-[0-9]{5}-of-[0-9]{5}\.safetensors))"
                        r"\.([0-9]{1,10})\.[0-9a-f]{8}\.tmp(?:\.partial)?")


def _remove_dead_temporaries(folder):
    """Temporary files that a converter no longer running left in folder (killed by SIGKILL, or a
    power cut, before publish() could clean up); called with the folder's lock held, so no other
    converter is writing one now.  Best effort: what cannot be removed stays, and the run goes on."""
    for name in os.listdir(folder):
        m = _TEMPORARY.fullmatch(name)
        path = os.path.join(folder, name)
        if m is None or _alive(int(m[1])) or not os.path.isfile(path) or os.path.islink(path):
            continue
        try:
            os.remove(path)
        except OSError:
            pass


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process (or a number past any pid): leave its file


def _failed(final, e):
    return ConvertError(f"writing {final} failed: {e.strerror or e} (nothing partial was left behind)")


def publish(final, write_to):
    """write_to(tmp) writes the complete file at tmp; then it is renamed to final.  On any
    failure every temporary file is removed."""
    tmp = _temporary_name(final)
    try:
        write_to(tmp)
        os.replace(tmp, final)
    except BaseException as e:
        for leftover in (tmp, tmp + ".partial"):
            try:
                os.remove(leftover)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise _failed(final, e) from e
        raise


def write_safetensors(final, tensors, metadata):
    publish(final, lambda tmp: write(tmp, tensors, metadata))


def write_json(final, obj):
    def dump(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
    publish(final, dump)


def copy_file(source, final):
    publish(final, lambda tmp: shutil.copyfile(source, tmp))


def remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ConvertError(f"cannot remove {path} ({e.strerror})") from None


def source_fingerprint(folder):
    """sha256 over config.json, the index, and for every *.safetensors file its name, size,
    mtime and header (names, dtypes, shapes, offsets); for a GGUF model (a file) over every
    part's name, size, mtime, metadata and tensor directory.
    Cheap (no tensor data is read), and it changes when the checkpoint is replaced, re-saved or
    edited in place."""
    h = hashlib.sha256()
    if os.path.isfile(folder):
        for path in split_parts(folder):
            st = os.stat(path)
            h.update(f"{os.path.basename(path)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            with open(path, "rb") as f:
                h.update(f.read(GGUFFile(path).data_start))  # metadata and the whole tensor directory
        return h.hexdigest()
    for name in ("config.json", "model.safetensors.index.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read(_MAX_HEADER) + b"\0")
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.endswith(".safetensors") or not os.path.isfile(path):
            continue
        st = os.stat(path)
        h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                h.update(f.read(min(n, _MAX_HEADER)))
    return h.hexdigest()[:32]
