"""The layer machinery shared by reload and offload.

What a block is (grouping checkpoint names, finding block lists in modules), which tensors of a layer a
graph can see, capturing a layer to meta records and rematerializing it zero-filled, re-pointing storage,
and a stream/event shim that makes the same overlap code run on CPU.

Limitations: block grouping relies on integer path segments; models that number blocks differently
(e.g. ``block_3``) need a declared plan.
"""

from weight_sync.layers.blocks import BlockKey, block_key, group_by_block, order_by_block
from weight_sync.layers.discovery import (
    find_block_lists,
    get_submodule_path,
    largest_uniform_module_list,
)
from weight_sync.layers.loading import check_loadable, default_weight_loader
from weight_sync.layers.meta import (
    TensorRecord,
    capture_layer,
    install_tensor,
    records_nbytes,
    rematerialize,
)
from weight_sync.layers.storage import repoint, strided_view
from weight_sync.layers.streams import DeviceShim, Event, Stream, device_shim
from weight_sync.layers.tensors import (
    TensorSignature,
    graph_visible_tensors,
    iter_graph_visible_tensors,
    layers_with_tensors,
    signatures,
    verify_signatures,
)

__all__ = [
    "BlockKey",
    "DeviceShim",
    "Event",
    "Stream",
    "TensorRecord",
    "TensorSignature",
    "block_key",
    "capture_layer",
    "check_loadable",
    "default_weight_loader",
    "device_shim",
    "find_block_lists",
    "get_submodule_path",
    "graph_visible_tensors",
    "group_by_block",
    "install_tensor",
    "iter_graph_visible_tensors",
    "largest_uniform_module_list",
    "layers_with_tensors",
    "order_by_block",
    "records_nbytes",
    "rematerialize",
    "repoint",
    "signatures",
    "strided_view",
    "verify_signatures",
]
