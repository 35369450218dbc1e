"""The KV-hash oracle (DESIGN.md §5, KsanaLLM's scheduler test harness idea), as a worker actor.

The fake model stores, for each computed token, a value derived from (token, position) in the slot its block table
names; the next token is a hash of everything it reads back through the block table. A wrong block id, a lost
write, a stale block after preemption or a chunk at the wrong offset changes what is read back, so the tokens
diverge from ``expected_tokens``, which runs the same arithmetic on the plain token list without any blocks.
"""

from __future__ import annotations

import hashlib

import trio

from events import Actor, handles
from events.messages import ExecuteStep, SampledToken, StepResult

VOCAB = 997
EOS = 0


def kv_value(token_id: int, position: int) -> int:
    return (token_id * 1_000_003 + position * 7919 + 17) % (1 << 31)


def next_token(values: list[int]) -> int:
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (VOCAB - 1)  # never EOS


def expected_tokens(prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(num_new):
        token = next_token([kv_value(t, p) for p, t in enumerate(tokens)])
        out.append(token)
        tokens.append(token)
    return out


class OracleWorker(Actor):
    """Answers ``ExecuteStep`` like the real worker, after ``step_latency(plan)`` seconds of (virtual) time."""

    name = "worker"

    def __init__(self, num_blocks: int, block_size: int, step_latency=lambda plan: 0.01) -> None:
        self.block_size = block_size
        self.slots = [-1] * (num_blocks * block_size)
        self.step_latency = step_latency
        self.num_steps = 0
        self.max_rows = 0
        self.num_chunked_rows = 0

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
                pos = row.start_position + i
                self.slots[row.block_ids[pos // bs] * bs + pos % bs] = kv_value(token, pos)
        for row in plan.rows:
            if row.do_sample:
                values = [self.slots[row.block_ids[p // bs] * bs + p % bs] for p in range(row.seq_len)]
                sampled[row.request_id] = SampledToken(next_token(values), 0.0)
        await trio.sleep(self.step_latency(plan))
        await self.send(StepResult(step_id=plan.step_id, sampled=sampled))
