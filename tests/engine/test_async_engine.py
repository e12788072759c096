"""Asynchronous updates of the reference engine: staged while generating, committed between two steps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from weight_sync.engine import ReferenceEngine, Rollout, VersionSpan
from weight_sync.errors import ManifestError, UpdateStateError
from weight_sync.layers.tensors import signatures
from weight_sync.manifest import Manifest
from weight_sync.testing import hf_config, random_weights

CFG = hf_config("qwen3", "tiny", dtype=torch.float32)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
NEW = 10


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(random_weights(CFG, seed=seed, dtype=torch.float32))


def _engine(seed: int, quantization: str | None = None) -> ReferenceEngine:
    return ReferenceEngine.from_config(CFG, weights=_weights(seed), dtype=torch.float32, quantization=quantization)


def _stage(engine: ReferenceEngine, seed: int, version: int, **options) -> None:
    assert engine.staging is not None
    w = _weights(seed)
    with engine.staging.begin_update(Manifest.from_named_tensors(w), version=version, **options) as s:
        s.load(w)


def _at(n: int, fn: Callable[[], None]) -> Callable[[int], None]:
    """An on_step callback that runs ``fn`` once, when ``n`` tokens of the batch exist."""
    def on_step(num_tokens: int) -> None:
        if num_tokens == n:
            fn()
    return on_step


def test_tokens_after_a_recomputing_commit_equal_a_fresh_engine_of_the_new_version_given_the_tokens_before() -> None:
    engine = _engine(0)
    engine.enable_staging(kv_after_commit="recompute")
    old = _engine(0).generate(PROMPTS, NEW)
    k = 4
    got = engine.generate_with_versions(PROMPTS, NEW, on_step=_at(k, lambda: _stage(engine, 1, 2)))
    continued = _engine(1).generate([p + r.token_ids[:k] for p, r in zip(PROMPTS, got)], NEW - k)
    for r, before, after in zip(got, old, continued):
        assert r.token_ids[:k] == before[:k]
        assert r.token_ids[k:] == after
    assert got[0].token_ids != old[0]  # the new version really changed what was generated


def test_tokens_after_a_commit_that_keeps_the_kv_equal_an_oracle_of_old_kv_and_new_weights() -> None:
    engine = _engine(0)
    engine.enable_staging(kv_after_commit="keep")
    k = 4
    got = engine.generate_with_versions(PROMPTS, NEW, on_step=_at(k, lambda: _stage(engine, 1, 2)))
    # The oracle: a fresh old-version engine computes the first k tokens (and their KV); a fresh
    # new-version engine continues from that KV cache, one decode step per token.
    old, new = _engine(0), _engine(1)
    first = old.generate(PROMPTS, k)
    new._ensure_static()
    assert old._cache is not None and new._cache is not None
    for dst, src in zip(new._cache.k + new._cache.v, old._cache.k + old._cache.v):
        dst.copy_(src)
    p, b = max(map(len, PROMPTS)), len(PROMPTS)
    s = new._ensure_static()
    s["pad"].zero_()
    s["pad"][:b].copy_(torch.tensor([p - len(x) for x in PROMPTS]))
    s["ids"].zero_()
    rows, nxt = [list(f) for f in first], torch.tensor([f[-1] for f in first])
    for i in range(NEW - k):
        s["ids"][:b, 0].copy_(nxt)
        s["slot"].fill_(p + k - 1 + i)
        new._decode_step()
        nxt = s["logits"][:b].argmax(-1)
        for row, tok in zip(rows, nxt.tolist()):
            row.append(tok)
    assert [r.token_ids for r in got] == rows


def test_spans_name_the_version_that_produced_each_token() -> None:
    engine = _engine(0)
    staging = engine.enable_staging()
    first_version = engine.weight_version
    got = engine.generate_with_versions(PROMPTS, NEW, on_step=_at(3, lambda: _stage(engine, 1, 2)))
    assert all(r.weight_versions == (VersionSpan(first_version, 0, 3), VersionSpan(2, 3, NEW)) for r in got)
    assert [got[0].version_of(i) for i in (0, 2, 3, NEW - 1)] == [first_version, first_version, 2, 2]
    assert engine.weight_version == 2 and staging.committed_version == 2
    _stage(engine, 2, 3)  # staged between two calls: committed before the next prefill
    again = engine.generate_with_versions(PROMPTS, 3)
    assert again == [Rollout(r.token_ids, (VersionSpan(3, 0, 3),)) for r in again]
    assert again == [Rollout(t, (VersionSpan(3, 0, 3),)) for t in _engine(2).generate(PROMPTS, 3)]


def test_a_failure_before_commit_never_changes_served_tokens() -> None:
    engine = _engine(0)
    staging = engine.enable_staging()
    reference = _engine(0).generate(PROMPTS, NEW)
    fingerprint = engine.fingerprint()

    def bad_update() -> None:
        w = _weights(1)
        session = staging.begin_update(Manifest.from_named_tensors(w), version=2)
        session.load(w[:5])  # five tensors of the new version are already on the twin
        with pytest.raises(ManifestError):
            session.load([(w[6][0], torch.zeros(3, 3))])

    got = engine.generate_with_versions(PROMPTS, NEW, on_step=_at(3, bad_update))
    assert [r.token_ids for r in got] == reference
    assert all(len(r.weight_versions) == 1 for r in got)
    assert engine.fingerprint() == fingerprint and not staging.has_pending()
    # The torn twin takes the next full update; the engine then serves exactly that version.
    _stage(engine, 1, 3)
    assert engine.generate(PROMPTS, NEW) == _engine(1).generate(PROMPTS, NEW)


def test_a_rolled_back_failure_leaves_the_version_it_superseded_pending() -> None:
    engine = _engine(0)
    staging = engine.enable_staging()
    _stage(engine, 1, 2)
    w = _weights(2)
    session = staging.begin_update(Manifest.from_named_tensors(w), version=3, rollback=True)
    session.load(w[:5])
    session.abort("the trainer died")
    assert staging.pending_version == 2
    assert engine.generate(PROMPTS, NEW) == _engine(1).generate(PROMPTS, NEW)


def test_a_newer_staged_version_supersedes_one_not_yet_committed() -> None:
    engine = _engine(0)
    _ = engine.enable_staging()
    _stage(engine, 1, 2)
    _stage(engine, 2, 3)
    report = engine.commit_staged()
    assert report is not None and report.version == 3 and report.superseded == (2,)
    assert engine.generate(PROMPTS, NEW) == _engine(2).generate(PROMPTS, NEW)
    assert engine.commit_staged() is None


def test_a_commit_keeps_every_live_tensor_where_the_graph_captured_it() -> None:
    engine = _engine(0)
    engine.enable_staging()
    before = signatures(engine.model)
    _stage(engine, 1, 2)
    report = engine.commit_staged()
    assert report is not None and report.num_bytes > 0
    assert signatures(engine.model) == before


def test_a_partial_staged_update_applies_to_the_committed_version() -> None:
    engine = _engine(0)
    engine.enable_staging()
    old, new = dict(_weights(0)), _weights(1)
    layer0 = [(n, t) for n, t in new if n.startswith("model.layers.0.")]
    with engine.staging.begin_update(Manifest.from_named_tensors(layer0), version=2, allow_partial=True) as s:  # type: ignore[union-attr]
        s.load(layer0)
    mixed = [(n, dict(layer0).get(n, t)) for n, t in old.items()]
    fresh = ReferenceEngine.from_config(CFG, weights=mixed, dtype=torch.float32)
    assert engine.generate(PROMPTS, NEW) == fresh.generate(PROMPTS, NEW)
    assert engine.fingerprint() == fresh.fingerprint()


def test_a_quantized_engine_takes_a_full_first_staged_update_and_matches_a_fresh_load() -> None:
    engine = _engine(0, quantization="fp8")
    staging = engine.enable_staging()
    assert not staging.seeded
    w = _weights(1)
    with pytest.raises(UpdateStateError, match="must be a full one"):
        staging.begin_update(Manifest.from_named_tensors(w[:3]), version=2, allow_partial=True)
    _stage(engine, 1, 2)
    assert engine.commit_staged() is not None
    assert engine.fingerprint() == _engine(1, quantization="fp8").fingerprint()


def test_commit_staged_is_refused_while_the_engine_generates() -> None:
    engine = _engine(0)
    engine.enable_staging()
    with pytest.raises(UpdateStateError, match="while generate"):
        engine.generate_with_versions(PROMPTS, 3, on_step=lambda n: engine.commit_staged() and None)


def test_a_partial_staged_update_is_refused_after_a_direct_update_of_the_live_model() -> None:
    engine = _engine(0)
    staging = engine.enable_staging()
    w = _weights(1)
    with engine.begin_update(Manifest.from_named_tensors(w), version=2) as s:
        s.load(w)
    with pytest.raises(UpdateStateError, match="updated directly since the last commit"):
        staging.begin_update(Manifest.from_named_tensors(w[:3]), version=3, allow_partial=True)
    _stage(engine, 2, 3)
    assert engine.generate(PROMPTS, NEW) == _engine(2).generate(PROMPTS, NEW)


def test_an_update_the_step_callback_makes_itself_starts_a_span_like_a_commit() -> None:
    engine = _engine(0)  # no staging: the pause-for-the-whole-update mode

    def update() -> None:
        w = _weights(1)
        with engine.begin_update(Manifest.from_named_tensors(w), version=2) as s:
            s.load(w)

    k = 4
    got = engine.generate_with_versions(PROMPTS, NEW, on_step=_at(k, update))
    assert all(r.weight_versions == (VersionSpan("initial", 0, k), VersionSpan(2, k, NEW)) for r in got)
    continued = _engine(1).generate([p + r.token_ids[:k] for p, r in zip(PROMPTS, got)], NEW - k)
    assert [r.token_ids[k:] for r in got] == continued
