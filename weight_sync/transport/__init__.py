"""Transports: move a trainer's weights into live engines, manifest first, bucket by bucket.

``WeightSender`` (trainer, rank 0) and ``WeightReceiver`` (each engine worker, ranks 1..N) share one
lifecycle: ``start_weight_update`` (the manifest, validated by every receiver before any write) ->
``update_weights`` (one or more calls) -> ``finish_weight_update`` (an all-or-nothing commit). Backends,
chosen by ``TransportConfig.backend``:

- ``nccl``: broadcast over a dedicated NCCL group (rendezvous through the sender's TCPStore), packed
  buckets of complete blocks in block order, two buffers and two streams allocated once, packing of bucket
  k+1 overlapped with the broadcast of bucket k, receiving overlapped with loading.
- ``gloo``: the same protocol and code path on CPU.
- ``ipc``: colocated on one GPU; the sender's buffers are exported once per receiver with CUDA IPC, and
  interprocess events order the receiver's loads behind the sender's packing on the device.
- ``shm``: colocated on one host; CPU shared-memory buffers, only names and sizes travel (JSON).
  shm and ipc signal READY / RELEASE per bucket over a Unix-socket doorbell, not collectives.
- ``disk``: a safetensors directory per update, read back in block order through mmap.

Route plans (:mod:`.routes`) say, for a sharded transfer, which trainer rank sends which region of
which tensor to which engine rank: trainer ranks announce their holdings (DTensor placements, FSDP
``Shard(0)``, whole tensors), engine ranks their needs (from their reload plan, or for the reference
engine from its config), and :func:`plan_routes` intersects and validates them before any byte moves.
The sharded data plane (``ShardedSender`` on every trainer rank, ``ShardedReceiver`` on every engine
rank) moves exactly those regions point to point, each engine rank receiving only its shard.

Every bucket carries an on-device checksum compared end to end. ``TransportConfig.verify``: 'deferred'
(default) compares trailers and checksums on the device while buckets keep flowing and reads the verdict
once per ``update_weights`` call, before the status exchange (a bad bucket may already be loaded, but the
update is never committed); 'before_load' reads each bucket's check back before loading it. Inside the
bucket loop the host never waits for the device except to stay a bounded number of buckets ahead;
buffer reuse is ordered with events. Metadata is JSON, never pickle; every wait has a timeout; a failure
on any rank is agreed through a status exchange and raised on every rank.

Limitations: ``WeightSender`` is one sender (rank 0) per transport whose receivers each get the full
model (the sharded plane is the resharding transfer); tensors must be produced in the manifest's block
order; after a communication failure (dead peer, timeout) the transport is broken and must be connected
again; ``ipc`` needs the receivers on the sender's physical GPU.
"""

from weight_sync.checksum import bucket_checksum, checksum_value
from weight_sync.transport.config import ALIGN_BYTES, BACKENDS, VERIFY_MODES, TransportConfig
from weight_sync.transport.layout import (
    Bucket,
    BucketLayout,
    Segment,
    check_block_order,
    plan_buckets,
)
from weight_sync.transport.push import PushHandle, push, push_client, push_to_staging
from weight_sync.transport.receiver import WeightReceiver
from weight_sync.transport.routes import (
    Holding,
    Need,
    NeedPiece,
    Piece,
    Route,
    RoutePlan,
    RoutePlanCache,
    copy_routes,
    layout_digest,
    plan_routes,
)
from weight_sync.transport.routes_layouts import (
    fsdp_holdings,
    holdings_from_dtensors,
    holdings_from_placements,
    merge_needs,
    needs_from_key_plans,
    needs_from_model,
    whole_holdings,
)
from weight_sync.transport.routes_reference import (
    reference_checkpoint_metas,
    reference_engine_needs,
)
from weight_sync.transport.sender import TransferReport, WeightSender
from weight_sync.transport.sharded import ShardedConfig, ShardedReport, ShardedSender
from weight_sync.transport.sharded_receiver import ShardedReceiver
from weight_sync.transport.status import AgreedChecksumError, AgreedManifestError, AgreedSourceError

__all__ = [
    "ALIGN_BYTES",
    "BACKENDS",
    "VERIFY_MODES",
    "AgreedChecksumError",
    "AgreedManifestError",
    "AgreedSourceError",
    "Bucket",
    "BucketLayout",
    "Holding",
    "Need",
    "NeedPiece",
    "Piece",
    "PushHandle",
    "Route",
    "RoutePlan",
    "RoutePlanCache",
    "Segment",
    "ShardedConfig",
    "ShardedReceiver",
    "ShardedReport",
    "ShardedSender",
    "TransferReport",
    "TransportConfig",
    "WeightReceiver",
    "WeightSender",
    "bucket_checksum",
    "check_block_order",
    "checksum_value",
    "copy_routes",
    "fsdp_holdings",
    "holdings_from_dtensors",
    "holdings_from_placements",
    "layout_digest",
    "merge_needs",
    "needs_from_key_plans",
    "needs_from_model",
    "plan_buckets",
    "plan_routes",
    "push",
    "push_client",
    "push_to_staging",
    "reference_checkpoint_metas",
    "reference_engine_needs",
    "whole_holdings",
]
