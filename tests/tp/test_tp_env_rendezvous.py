"""Ranks placed by the standard torch.distributed environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``RANK``), as on several machines or under ``torchrun``, here on loopback: rank 1 is a separate process started
by hand (``python -m ksana.worker.tp_rank``, or the same ksana program as rank 0, as torchrun does), rank 0 is the
engine in this process. TP=2 placed this way must generate exactly what TP=1 does, and rank 1 must exit with code
0 when the engine closes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ksana import LLM, SamplingParams
from ksana.worker.tp_runner import TPModelRunner
from tests.model_factory import make_checkpoint, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(num_device_blocks=32, block_token_num=4, device="cpu")  # gloo: two ranks need no two GPUs
RENDEZVOUS_TIMEOUT_S = 30.0  # a rank that never shows up fails the test in bounded time instead of hanging it
EXIT_WAIT_S = 20.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _bounded_launch(monkeypatch) -> None:
    """The engine passes no timeout to ``launch``; bound rank 0's rendezvous and collectives for this test."""
    launch = TPModelRunner.launch.__func__

    def bounded(cls, *args, **kwargs):
        return launch(cls, *args, **{**kwargs, "timeout_s": RENDEZVOUS_TIMEOUT_S})

    monkeypatch.setattr(TPModelRunner, "launch", classmethod(bounded))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A tiny qwen2 checkpoint (2 KV heads: one per rank), prompts, and the TP=1 greedy tokens for them."""
    model_dir = make_checkpoint(tmp_path_factory.mktemp("tp_env"), "qwen2")
    prompts = random_prompts([7, 19, 12], seed=4)
    return model_dir, prompts, _tokens(LLM(model=str(model_dir), **ENGINE), prompts)


def _rank1_command(how: str, model_dir) -> list[str]:
    if how == "tp_rank":  # how a rank on another machine is started
        return [sys.executable, "-m", "ksana.worker.tp_rank"]
    # torchrun runs the same ksana program as every rank; the engine of rank > 0 serves its rank, then exits 0.
    script = (f"from ksana import LLM; LLM(model={str(model_dir)!r}, tensor_para_size=2, "
              + ", ".join(f"{k}={v!r}" for k, v in ENGINE.items()) + ")")
    return [sys.executable, "-c", script]


@pytest.mark.parametrize("how", ["tp_rank", "ksana_program"])
def test_env_placed_rank_1_process_matches_tp1_and_exits_when_engine_closes(reference, tmp_path, monkeypatch,
                                                                            how):
    model_dir, prompts, expected = reference

    world = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    for name in ("KSANA_TP_LOOPBACK", "KSANA_TP_DEVICE", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)  # the plain env:// rendezvous, not ksana's own spawning
    rank1_env = dict(os.environ, **world, RANK="1", HF_HUB_OFFLINE="1", KSANA_TP_DEVICE="cpu")
    for name, value in {**world, "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    _bounded_launch(monkeypatch)

    stderr_path = tmp_path / "rank1.stderr"
    llm = None
    with stderr_path.open("wb") as stderr:
        rank1 = subprocess.Popen(_rank1_command(how, model_dir), env=rank1_env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        llm = LLM(model=str(model_dir), tensor_para_size=2, **ENGINE)
        runner = llm.engine.tp_runner
        assert runner.world_size == 2
        assert runner.procs == []  # placed by the environment: ksana spawned nothing
        assert llm.engine.model.rank_shape.num_kv_heads == 1
        assert _tokens(llm, prompts) == expected
        # Rank 1 really loaded its own half, as large as rank 0's: it reported its parameter bytes through the store.
        rank0_bytes, rank1_bytes = runner.rank_param_bytes()
        assert rank1_bytes == rank0_bytes
        assert rank1.poll() is None, stderr_path.read_text()

        llm.engine.close()
        try:
            code = rank1.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 1 did not exit within {EXIT_WAIT_S} s of the engine closing")
        assert code == 0, stderr_path.read_text()
    finally:
        if llm is not None:
            llm.engine.close()
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()
