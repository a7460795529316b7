"""How fast one GPU serves LLM requests and how busy it looks meanwhile (serving presets).

The trace replay (``polca.workload.replay``) and the row simulator (``polca.sim.model``)
both need, per GPU type, how long a prompt's prefill and an output token's decode take;
the replay also needs the utilization each phase shows. One replica of a 13B-parameter
FP16 model per GPU (26 GB of weights) is assumed [U], with these constants
(``SERVING_MODELS``):

- decode is memory-bound: one pass over the weights per token, 26 GB / 3.35 TB/s (H100 SXM)
  ~ 8 ms, 26 GB / 2.04 TB/s (A100 80GB SXM) ~ 13 ms, 26 GB / 4.8 TB/s (H200) ~ 5.5 ms, plus
  scheduling and attention overheads: 12, 20 and 9 ms per token;
- prefill is compute-bound: 2 x 13e9 FLOP per token; at ~35-40 % of the dense BF16 peak
  (989 TFLOP/s H100/H200, 312 TFLOP/s A100) that is ~13,000 and ~5,000 tokens/s;
- decode utilization ``0.45 + 0.08 x active decodes`` and a prefill at 100 % follow the
  simulator recipe in ``polca-paper.md`` §4.2 (decode ~0.45-0.65 x TDP, prefill ~1 x TDP);
- a resident model idles at 7 % utilization, which the simulated backend turns into ~118 W
  on H100 and ~81 W on A100 (measured 121.7 W and 80 W, ``polca-paper.md`` §4.1).

Presets are keyed by the GPU model names of ``polca.physics.presets``. Data and two pure
functions; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServingModel:
    """How fast one GPU serves requests and how busy it looks meanwhile (module docstring)."""

    name: str
    prefill_tokens_per_s: float  # prompt tokens per second, one prefill at a time
    decode_s_per_token: float  # time between output tokens, independent of the batch
    prefill_util: float = 1.0  # during a prefill (compute-bound)
    decode_util_base: float = 0.45  # decoding one request ...
    decode_util_per_request: float = 0.08  # ... plus this per request in the batch
    resident_util: float = 0.07  # model loaded, nothing to do

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.decode_s_per_token > 0):
            msg = f"{self.name}: prefill and decode speeds must be positive"
            raise ValueError(msg)
        for name in ("prefill_util", "decode_util_base", "decode_util_per_request"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                msg = f"{self.name}: {name} must be within 0..1"
                raise ValueError(msg)
        if not 0.0 <= self.resident_util <= 1.0:
            msg = f"{self.name}: resident_util must be within 0..1"
            raise ValueError(msg)

    def utilization(self, prefills: int, decodes: int) -> float:
        """Utilization with ``prefills`` prefills running and ``decodes`` requests decoding."""
        if prefills > 0:
            return self.prefill_util
        if decodes > 0:
            return min(1.0, self.decode_util_base + self.decode_util_per_request * decodes)
        return self.resident_util


SERVING_MODELS: dict[str, ServingModel] = {
    m.name.lower(): m
    for m in (
        ServingModel("H100-SXM", prefill_tokens_per_s=13_000.0, decode_s_per_token=0.012),
        ServingModel("H200-SXM", prefill_tokens_per_s=13_000.0, decode_s_per_token=0.009),
        ServingModel("A100-SXM4", prefill_tokens_per_s=5_000.0, decode_s_per_token=0.020),
        ServingModel("A100-SXM4-40GB", prefill_tokens_per_s=5_000.0, decode_s_per_token=0.020),
    )
}


def serving_model(name: str | ServingModel) -> ServingModel:
    """Look up a serving preset by GPU model name (as in ``polca.physics.presets``)."""
    if isinstance(name, ServingModel):
        return name
    try:
        return SERVING_MODELS[name.lower()]
    except KeyError as exc:
        known = ", ".join(m.name for m in SERVING_MODELS.values())
        msg = f"no serving preset for GPU model {name!r}; known: {known}"
        raise ValueError(msg) from exc


__all__ = ["SERVING_MODELS", "ServingModel", "serving_model"]
