"""The fingerprint of an offloaded model as it serves: streamed blocks checksummed one at a time.

``weight_sync.fingerprint(model)`` hashes every graph-visible tensor where it lies. For an offloaded
model that is wrong for streamed blocks (their parameters point at whichever slot last held them), and
with AllGather no rank holds a block's full bytes on the host. Here each streamed block is loaded into
one reusable device buffer exactly as a restore load does (gathered with AllGather), its tensors are
checksummed there, and ``weight_sync.fingerprint`` forms the digest with those checksums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from weight_sync.checksum import tensor_checksums
from weight_sync.reload.report import fingerprint

if TYPE_CHECKING:
    from weight_sync.offload.handle import OffloadHandle

__all__ = ["offload_fingerprint"]


def offload_fingerprint(handle: OffloadHandle, module: nn.Module) -> str:
    """What ``weight_sync.fingerprint(module)`` gives for ``module`` resident with the served weights."""
    streamer = handle.streamer
    sums: dict[int, int] = {}
    if streamer is not None and handle.layouts:
        streamer.drain()
        size = max(lay.padded_bytes if handle.gather.active else lay.nbytes for lay in handle.layouts)
        buf = torch.empty(max(size, 1), dtype=torch.uint8, device=handle.device)
        for lay in handle.layouts:
            streamer.load_into(lay.index, buf)
            handle.shim.synchronize()
            # Read back before the next block reuses the buffer (tensor_checksums waits for its sums).
            sums.update(zip((id(p.tensor) for p in lay.placements),
                            tensor_checksums([p.view(buf) for p in lay.placements])))
        del buf
    return fingerprint(module, sums)
