"""ModelRunner: a step's batch preparation (the flat tokens, positions and attention metadata of its rows) and
where its greedy rows' tokens come from."""

from __future__ import annotations

import attrs
import pytest
import torch

from ksana.messages import PLACEHOLDER_TOKEN, ScheduledRow, StepPlan
from ksana.models import load_model
from ksana.sampling_params import SamplingParams
from ksana.worker.kv_cache import KVCache
from ksana.worker.model_runner import ModelRunner
from tests.model_factory import make_checkpoint

BLOCK = 4


@attrs.define
class StubCache:
    block_size: int = BLOCK
    num_swa_blocks: int = 0


def runner(num_swa_blocks: int = 0) -> ModelRunner:
    return ModelRunner(torch.nn.Identity(), StubCache(num_swa_blocks=num_swa_blocks))


def row(rid: str, tokens, start: int, blocks, swa=()) -> ScheduledRow:
    return ScheduledRow(request_id=rid, token_ids=tuple(tokens), start_position=start, block_ids=tuple(blocks),
                        do_sample=True, swa_block_ids=tuple(swa))


def reference(rows, tables):
    """Token by token: its id, its position and its KV slot through the row's block table."""
    ids, positions, slots = [], [], []
    for r, table in zip(rows, tables, strict=True):
        for offset, token in enumerate(r.token_ids):
            pos = r.start_position + offset
            ids.append(token)
            positions.append(pos)
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
    return ids, positions, slots


def test_decodes_then_prefills_flat_layout():
    rows = [
        row("a", [11], 9, [7, 3, 5]),  # decode at position 9: block 5, offset 1
        row("b", [12], 0, [2]),  # decode of a one-token context
        row("c", [13, 14, 15, 16, 17, 18], 2, [8, 1]),  # a prefill chunk over cached positions 0..1
        row("d", [19, 20], 0, [6]),
    ]
    input_ids, positions, meta = runner().prepare_inputs(rows)
    ids, pos, slots = reference(rows, [r.block_ids for r in rows])
    assert input_ids.tolist() == ids and input_ids.dtype == torch.int64
    assert positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc.tolist() == [0, 1, 2, 8, 10]
    assert meta.seq_lens.tolist() == [10, 1, 8, 2] == meta.seq_lens_list
    assert meta.query_lens_list == [1, 1, 6, 2]
    assert meta.block_tables.tolist() == [[7, 3, 5], [2, 0, 0], [8, 1, 0], [6, 0, 0]]
    assert meta.num_decodes == 2 and meta.max_seq_len == 10 and meta.swa is None
    for t in (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables, positions):
        assert t.dtype == torch.int64


def test_all_decode_step():
    rows = [row(str(i), [100 + i], 2 * i + 1, [i, 10 + i, 20 + i]) for i in range(5)]
    input_ids, positions, meta = runner().prepare_inputs(rows)
    ids, pos, slots = reference(rows, [r.block_ids for r in rows])
    assert (input_ids.tolist(), positions.tolist(), meta.slot_mapping.tolist()) == (ids, pos, slots)
    assert meta.num_decodes == 5 and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5]


def test_swa_view_uses_swa_blocks_with_outside_window_as_block_zero():
    rows = [row("a", [1], 9, [7, 3, 5], swa=[-1, 4, 6]), row("b", [2, 3, 4], 0, [8], swa=[9])]
    _, _, meta = runner(num_swa_blocks=16).prepare_inputs(rows)
    swa_tables = [[0, 4, 6], [9]]
    _, _, slots = reference(rows, swa_tables)
    assert meta.swa.slot_mapping.tolist() == slots
    assert meta.swa.block_tables.tolist() == [[0, 4, 6], [9, 0, 0]]
    assert meta.swa.seq_lens_list == meta.seq_lens_list and meta.swa.num_decodes == 1


def test_placeholders_take_the_previous_steps_tokens_in_decode_and_mixed_steps():
    previous = {"a": 501, "b": 502}
    decodes = [row("a", [PLACEHOLDER_TOKEN], 9, [7, 3, 5]), row("x", [40], 3, [1]),
               row("b", [PLACEHOLDER_TOKEN], 0, [2])]
    input_ids, _, _ = runner().prepare_inputs(decodes, previous)
    assert input_ids.tolist() == [501, 40, 502]
    mixed = [*decodes, row("c", [13, 14, 15], 0, [8])]
    input_ids, positions, meta = runner().prepare_inputs(mixed, previous)
    assert input_ids.tolist() == [501, 40, 502, 13, 14, 15] and positions.tolist() == [9, 3, 0, 0, 1, 2]
    assert meta.num_decodes == 3


def test_a_placeholder_the_previous_step_did_not_sample_is_a_clear_error():
    with pytest.raises(RuntimeError, match="request b: its token is a placeholder"):
        runner().prepare_inputs([row("a", [PLACEHOLDER_TOKEN], 9, [7, 3, 5]), row("b", [PLACEHOLDER_TOKEN], 0, [2])],
                                {"a": 501})


def test_plain_greedy_rows_take_the_fused_lm_head_and_get_the_logits_paths_tokens(tmp_path):
    """Nine plain greedy decode rows (the fused path's smallest batch): the tokens the logits path gives, and the
    log-probabilities to float32 rounding; a row asking for top logprobs sends the whole step through the logits."""
    model = load_model(make_checkpoint(tmp_path, "llama"), dtype=torch.float32)
    if model.ops.lm_head_greedy is None:
        pytest.skip(f"the {model.ops.name} kernels on this CPU have no fused greedy lm_head")
    fused_ops, logits_ops = model.ops, attrs.evolve(model.ops, lm_head_greedy=None)
    calls = []

    def counted(*args, **kwargs):
        result = fused_ops.lm_head_greedy(*args, **kwargs)
        calls.append(result is not None)
        return result

    def step(ops, params):
        model.ops = ops
        cache = KVCache.allocate(model.shape, 32, BLOCK, torch.float32, "cpu")
        rows = tuple(ScheduledRow(request_id=str(i), token_ids=(7 + 11 * i,), start_position=i,
                                  block_ids=(3 * i, 3 * i + 1, 3 * i + 2), do_sample=True, sampling_params=params[i])
                     for i in range(9))
        sampled, _, _ = ModelRunner(model, cache).execute(StepPlan(step_id=0, rows=rows))
        return [sampled[str(i)] for i in range(9)]

    greedy = [SamplingParams(temperature=0.0)] * 9
    expected = step(logits_ops, greedy)
    fused = step(attrs.evolve(fused_ops, lm_head_greedy=counted), greedy)
    assert calls == [True]
    assert [t.token_id for t in fused] == [t.token_id for t in expected]
    assert [t.logprob for t in fused] == pytest.approx([t.logprob for t in expected], abs=1e-5)
    calls.clear()
    asks_top = [*greedy[:8], SamplingParams(temperature=0.0, logprobs=2)]
    with_top = step(attrs.evolve(fused_ops, lm_head_greedy=counted), asks_top)
    assert calls == [] and with_top[8].top_logprobs is not None
    assert [t.token_id for t in with_top] == [t.token_id for t in expected]
