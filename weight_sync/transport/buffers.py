"""Transport buffers, allocated once per connection: plain, CPU shared memory, or CUDA IPC exports.

``shm``: the sender creates one file per buffer in a tmpfs directory (mode 0600, O_EXCL, a random name),
maps it shared, and sends the receivers only the file name and size as JSON; receivers validate the name
before turning it into a path, map the same file, and the sender unlinks the files once every receiver
has mapped them, so nothing is left behind if a process dies later.

``ipc``: the sender exports each buffer once per receiver with torch's CUDA IPC sharing (the handle, the
ref-counter slot and the allocation event, as JSON); each receiver imports it exactly once and releases it
when the transport closes, so the producer's ref count returns to zero and ``torch.cuda.ipc_collect``
frees the allocation. Exporting once per receiver matters: one export carries one reference, and two
imports of it would drive the count negative.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import uuid
from pathlib import Path

import torch

from weight_sync.errors import TransportError
from weight_sync.transport.wire import IpcBufferHandle, ShmBufferHandle, b64decode, b64encode

__all__ = [
    "allocate_buffers",
    "create_shm_buffers",
    "device_uuid",
    "export_ipc_buffer",
    "import_ipc_buffer",
    "open_shm_buffer",
    "unlink_shm_buffers",
]

log = logging.getLogger(__name__)

_SHM_NAME = re.compile(r"^weight_sync-[0-9a-f]{32}-[0-9]{1,2}$")


def allocate_buffers(count: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
    """``count`` uint8 buffers of ``nbytes`` on ``device`` (pinned on the host when a GPU will read them)."""
    return [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]


def create_shm_buffers(directory: str, count: int, nbytes: int) -> tuple[list[torch.Tensor], list[ShmBufferHandle]]:
    """Create ``count`` shared-memory buffers in ``directory``; returns tensors and their handles."""
    d = Path(directory)
    if not d.is_dir():
        raise TransportError(f"shm directory {directory} does not exist (set TransportConfig.shm_dir)")
    token = uuid.uuid4().hex
    tensors, handles = [], []
    try:
        for i in range(count):
            name = f"weight_sync-{token}-{i}"
            path = d / name
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            handles.append(ShmBufferHandle(name=name, directory=str(d.resolve()), nbytes=nbytes))
            tensors.append(_map(path, nbytes))
    except OSError as e:
        unlink_shm_buffers(handles)
        raise TransportError(f"cannot create a {nbytes}-byte shm buffer in {directory}: {e}") from e
    return tensors, handles


def _map(path: Path, nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[call-overload,arg-type]


def open_shm_buffer(handle: ShmBufferHandle) -> torch.Tensor:
    """Map a sender's shm buffer after checking that the name cannot escape its directory."""
    if not _SHM_NAME.match(handle.name):
        raise TransportError(f"shm buffer name {handle.name!r} is not a weight_sync buffer name")
    d = Path(handle.directory)
    if not d.is_absolute() or not d.is_dir():
        raise TransportError(f"shm directory {handle.directory!r} is not an existing absolute directory")
    path = d / handle.name
    try:
        st = path.lstat()
    except OSError as e:
        raise TransportError(f"shm buffer {path} cannot be opened: {e}") from e
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise TransportError(f"shm buffer {path} is not a regular file owned by this user")
    if st.st_size != handle.nbytes:
        raise TransportError(f"shm buffer {path} holds {st.st_size} bytes, the sender announced {handle.nbytes}")
    return _map(path, handle.nbytes)


def unlink_shm_buffers(handles: list[ShmBufferHandle]) -> None:
    """Remove the buffer files (mappings stay valid until every process drops them)."""
    for h in handles:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(Path(h.directory) / h.name)


def device_uuid(device: torch.device) -> str:
    """The physical identity of a CUDA device (stable across CUDA_VISIBLE_DEVICES renumbering)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def export_ipc_buffer(buffer: torch.Tensor) -> IpcBufferHandle:
    """Export ``buffer`` (a whole CUDA allocation) for exactly one importer."""
    if not buffer.is_cuda or buffer.storage_offset() != 0:
        raise TransportError("CUDA IPC export needs a CUDA buffer that starts its storage")
    (
        _device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync,
    ) = buffer.untyped_storage()._share_cuda_()
    return IpcBufferHandle(
        device_uuid=device_uuid(buffer.device),
        handle=b64encode(handle),  # type: ignore[arg-type]
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=b64encode(ref_handle),  # type: ignore[arg-type]
        ref_counter_offset=int(ref_offset),
        event_handle=b64encode(event_handle) if event_handle is not None else None,
        event_sync_required=bool(event_sync),
        nbytes=buffer.numel(),
    )


def import_ipc_buffer(h: IpcBufferHandle) -> torch.Tensor:
    """Import a sender's CUDA buffer once; dropping the returned tensor releases the reference."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    local = None
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == h.device_uuid:
            local = i
            break
    if local is None:
        raise TransportError(
            f"CUDA IPC needs the receiver on the sender's GPU (uuid {h.device_uuid}); this process sees "
            f"{[device_uuid(torch.device('cuda', i)) for i in range(torch.cuda.device_count())]}"
        )
    return rebuild_cuda_tensor(
        torch.Tensor, (h.nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8, local,
        b64decode(h.handle), h.storage_size_bytes, h.storage_offset_bytes, False,
        b64decode(h.ref_counter_handle), h.ref_counter_offset,
        b64decode(h.event_handle) if h.event_handle is not None else None, h.event_sync_required,
    )
