"""Direct ``param.weight_loader(param, w, ...)`` calls inside a layerwise reload feed its session.

vLLM's ``initialize_layerwise_reload`` wraps every parameter's loader, so code that calls loaders itself
(instead of ``model.load_weights``) is part of the reload. Here each call is mapped back to the checkpoint
key whose load makes exactly that call (the plan recorded it when it dry-ran the model's loaders), and the
session loads that key: validated, counted, transactional, rolled back or torn on failure like any other
tensor. A call that matches no key (or several) is refused before it writes: it would otherwise change
live weights outside the transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from weight_sync.errors import UnknownTensorError
from weight_sync.layers.loading import check_loadable
from weight_sync.reload.plan import LoaderCall, Plan, loader_call_args

if TYPE_CHECKING:
    from weight_sync.reload.session import UpdateSession
    from weight_sync.reload.state import ModelState

__all__ = ["route_weight_loaders"]

_MISSING = object()


def route_weight_loaders(session: UpdateSession) -> Callable[[], None]:
    """Make every live tensor's ``weight_loader`` feed ``session``; returns the function that undoes it.

    Tensors without a loader get one for the session (vLLM code calls
    ``getattr(param, "weight_loader", default_weight_loader)``), which loads them whole. Staging that a
    processed layer gets while the session is open is routed the same way (``session.route``), so a
    caller that looks parameters up again mid-update still reaches the session.
    """
    whole = _whole_tensor_keys(session.state, session.plan)
    saved: list[tuple[torch.Tensor, Any]] = []

    def install(layer: str, name: str, t: torch.Tensor) -> Any:
        original = getattr(t, "weight_loader", _MISSING)
        # Calls are recognised by the model-format loader's signature (the one the plan recorded): a
        # kernel tensor (fp8 weight) may carry another loader, or none.
        attrs = session.state.layers[layer].records[name].attrs
        model_loader = attrs.get("weight_loader", attrs.get("_weight_loader"))
        if model_loader is None and original is not _MISSING:
            model_loader = original
        t.weight_loader = _routed(session, whole, layer, name, original, model_loader)  # type: ignore[attr-defined]
        return original

    for info in session.state.layers.values():
        mod = info.module
        for name in info.records:
            t: torch.Tensor | None = mod._parameters.get(name)
            if t is None:
                t = mod._buffers.get(name)
            if t is not None and not t.is_meta:
                saved.append((t, install(info.name, name, t)))
    session.route = install

    def undo() -> None:
        session.route = None
        for t, original in saved:
            if original is _MISSING:
                del t.weight_loader  # type: ignore[attr-defined]
            else:
                t.weight_loader = original  # type: ignore[attr-defined]

    return undo


def _whole_tensor_keys(state: ModelState, plan: Plan) -> dict[LoaderCall, str | None]:
    """(layer, tensor, no arguments) -> the key whose only copy fills that tensor whole, as it is.

    These keys' loads made no ``weight_loader`` call to record (the model copied them with its default
    loader), yet ``param.weight_loader(param, w)`` on their tensor means exactly that key.
    """
    out: dict[LoaderCall, str | None] = {}
    for kp in plan.keys.values():
        if kp.mode != "copy" or len(kp.ops) != 1:
            continue
        op = kp.ops[0]
        rec = state.layers[op.layer].records.get(op.tensor)
        if (rec is None or not op.src_whole or op.dst_offset != 0 or op.dst_size != tuple(rec.shape)
                or op.dst_stride != tuple(rec.stride)):
            continue
        call: LoaderCall = (op.layer, op.tensor, ())
        out[call] = kp.name if out.get(call, kp.name) == kp.name else None
    return out


def _routed(session: UpdateSession, whole: dict[LoaderCall, str | None], layer: str, tensor: str,
            original: Any, model_loader: Callable[..., Any] | None) -> Callable[..., Any]:
    def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if session.loading or session.status != "open":
            # The session's own loads (a key whose plan runs the real loader) reach here through the
            # model's load_weights: they write where the session put them.
            if original is _MISSING:
                check_loadable(param, loaded_weight)
                return param.data.copy_(loaded_weight)
            return original(param, loaded_weight, *args, **kwargs)
        bound = (loader_call_args(model_loader, (param, loaded_weight, *args), kwargs)
                 if model_loader is not None else ())
        call: LoaderCall = (layer, tensor, bound or ())
        key = session.plan.loader_calls.get(call, _MISSING)
        if key is _MISSING and not args and not kwargs:
            key = whole.get(call, _MISSING)
        if not isinstance(key, str):
            where = f"{layer}.{tensor}" if layer else tensor
            detail = ", ".join(f"{k}={v!r}" for k, v in (bound or ())) or "no shard arguments"
            why = ("several checkpoint tensors make this call" if key is None
                   else "no checkpoint tensor the engine expects makes this call")
            exc = UnknownTensorError(
                f"{where}: weight_loader call with {detail} inside update {session.version!r}: {why}; "
                "load it by its checkpoint name through model.load_weights instead"
            )
            session.abort(reason=f"{type(exc).__name__}: {exc}")
            raise exc
        session.load(((key, loaded_weight),))
        return None

    return weight_loader
