"""KsanaLLM's 11-column perf CSV (``run_model_performance --output``), byte for byte, for users of its tooling.

One row per batch and DP group (only ``dp_0`` here). As in KsanaLLM, averages have three decimals, a space
precedes the decode group in the header and in every row, and the time is the forward pass only, averaged over
the profile (stat) rounds.
"""

from __future__ import annotations

from pathlib import Path

from ksana.perf.perf_config import BatchSpec

CSV_HEADER = (
    "profile_round,layer_forward_round,total_requests,total_sequence_len,"
    "prefill_requests,prefill_avg_seq_len,prefill_avg_forwarding_tokens,"
    " decode_requests,decode_avg_seq_len,decode_avg_forwarding_tokens,"
    "avg_time_ms_per_profile_round"
)


def _avg(total: int, count: int) -> float:
    return total / count if count else 0.0


def csv_row(batch: BatchSpec, profile_round: int, layer_forward_round: int, avg_time_ms: float) -> str:
    prefill = [r for r in batch.requests if not r.is_decode]
    decode = [r for r in batch.requests if r.is_decode]

    def group(specs) -> tuple[int, float, float]:
        n = sum(r.request_num for r in specs)
        seq = sum(r.sequence_len * r.request_num for r in specs)
        fwd = sum(r.forwarding_token_num * r.request_num for r in specs)
        return n, _avg(seq, n), _avg(fwd, n)

    p_n, p_seq, p_fwd = group(prefill)
    d_n, d_seq, d_fwd = group(decode)
    return (f"{profile_round},{layer_forward_round},{batch.num_requests},{batch.total_sequence_len},"
            f"{p_n},{p_seq:.3f},{p_fwd:.3f}, {d_n},{d_seq:.3f},{d_fwd:.3f},{avg_time_ms:.3f}")


def write_perf_csv(path: Path, rows: list[tuple[BatchSpec, float]], profile_round: int,
                   layer_forward_round: int) -> None:
    """``rows``: each batch with its mean forward time in milliseconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [CSV_HEADER] + [csv_row(b, profile_round, layer_forward_round, ms) for b, ms in rows]
    path.write_text("\n".join(lines) + "\n")
