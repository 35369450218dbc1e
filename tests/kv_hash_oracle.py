"""The KV-hash oracle (DESIGN.md §5, KsanaLLM's scheduler test harness idea), as a worker actor.

The fake model stores, for each computed token, a value derived from (token, position) in the slot its block table
names; the next token is a hash of everything it reads back through the block table. A wrong block id, a lost
write, a stale block after preemption or a chunk at the wrong offset changes what is read back, so the tokens
diverge from ``expected_tokens``, which runs the same arithmetic on the plain token list without any blocks.

With ``sliding_window`` the fake model also has a sliding layer: values are written to the SWA slots the rows'
``swa_block_ids`` name, and the hash also covers the last ``sliding_window`` values read back from there, so a wrong
SWA block (a reused prefix whose window was evicted, a block released too early) changes the tokens too.
"""

from __future__ import annotations

import hashlib

import trio

from ksana.events import Actor, handles
from ksana.messages import PLACEHOLDER_TOKEN, ExecuteStep, SampledToken, StepResult

VOCAB = 997
EOS = 0


def kv_value(token_id: int, position: int) -> int:
    return (token_id * 1_000_003 + position * 7919 + 17) % (1 << 31)


def next_token(values: list[int]) -> int:
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (VOCAB - 1)  # never EOS


def expected_tokens(prompt: list[int], num_new: int, sliding_window: int | None = None) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(num_new):
        values = [kv_value(t, p) for p, t in enumerate(tokens)]
        if sliding_window is not None:
            values += values[max(0, len(values) - sliding_window):]
        token = next_token(values)
        out.append(token)
        tokens.append(token)
    return out


class OracleWorker(Actor):
    """Answers ``ExecuteStep`` like the real worker, after ``step_latency(plan)`` seconds of (virtual) time."""

    name = "worker"

    def __init__(self, num_blocks: int, block_size: int, step_latency=lambda plan: 0.01,
                 sliding_window: int | None = None, num_swa_blocks: int = 0) -> None:
        self.block_size = block_size
        self.slots = [-1] * (num_blocks * block_size)
        self.sliding_window = sliding_window
        self.swa_slots = [-1] * (num_swa_blocks * block_size)
        self.step_latency = step_latency
        self.num_steps = 0
        self.max_rows = 0
        self.num_chunked_rows = 0
        self.num_placeholder_rows = 0
        self.last_sampled: dict[str, int] = {}  # async scheduling: a placeholder is the last step's token

    @handles(ExecuteStep)
    async def on_execute(self, msg: ExecuteStep) -> None:
        plan = msg.plan
        bs = self.block_size
        self.num_steps += 1
        self.max_rows = max(self.max_rows, len(plan.rows))
        sampled = {}
        for row in plan.rows:
            if not row.do_sample and row.num_new_tokens > 1:
                self.num_chunked_rows += 1
            for i, token in enumerate(row.token_ids):
                if token == PLACEHOLDER_TOKEN:
                    assert plan.has_placeholders and row.num_new_tokens == 1, f"{row.request_id}: stray placeholder"
                    token = self.last_sampled[row.request_id]
                    self.num_placeholder_rows += 1
                pos = row.start_position + i
                self.slots[row.block_ids[pos // bs] * bs + pos % bs] = kv_value(token, pos)
                if self.sliding_window is not None:
                    assert row.swa_block_ids[pos // bs] >= 0, f"{row.request_id}: no SWA block for position {pos}"
                    self.swa_slots[row.swa_block_ids[pos // bs] * bs + pos % bs] = kv_value(token, pos)
        for row in plan.rows:
            if row.do_sample:
                values = [self.slots[row.block_ids[p // bs] * bs + p % bs] for p in range(row.seq_len)]
                if self.sliding_window is not None:
                    first = max(0, row.seq_len - self.sliding_window)
                    values += [self._swa_value(row.swa_block_ids[p // bs], p) for p in range(first, row.seq_len)]
                sampled[row.request_id] = SampledToken(next_token(values), 0.0)
        self.last_sampled = {rid: token.token_id for rid, token in sampled.items()}
        await trio.sleep(self.step_latency(plan))
        await self.send(StepResult(step_id=plan.step_id, sampled=sampled))

    def _swa_value(self, block_id: int, position: int) -> int:
        if block_id < 0:
            return -2  # a window position without an SWA block: always a wrong token
        return self.swa_slots[block_id * self.block_size + position % self.block_size]
