"""GPU/server profiles: every constant of the simulator's model in one YAML file, with its source.

Why: the planner's answer rests on a dozen constants (per-phase power and speed, how each
phase responds to the SM clock, what the rest of a server draws). A site must be able to
read where each comes from, fit them to its own GPUs (``bench/gpu_check.py`` writes a
profile from a clock sweep) and run sensitivity studies, without editing code. So the
shipped profiles (``polca/data/profiles/*.yaml``) are the only home of these figures: the
built-in presets (``polca.sim.model.SIM_GPUS`` and ``SERVER_PRESETS``) are loaded from
them, and ``polca simulate|plan --profile NAME|FILE`` picks one.

A profile is hostile input like any file: read bounded (``yamlkit``), validated strictly
(unknown keys refused, every constant within a physical range, a source for each, the
cross-field rules: min <= max), and any problem becomes a ``SimConfigError`` naming the
file and the field. No I/O besides reading the file; no numpy.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from polca import yamlkit
from polca.errors import SimConfigError

ModelT = TypeVar("ModelT", bound=BaseModel)
PROFILE_LIMITS: Final = yamlkit.YamlLimits(max_bytes=64 * 1024, max_depth=8, max_aliases=0)
"""A profile is a few dozen lines."""

_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class Constant(BaseModel):
    """One figure of the model and where it comes from."""

    model_config = _CONFIG

    value: float | int
    source: str = Field(min_length=3, max_length=400)


_GPU_BOUNDS: Final[dict[str, tuple[float, float]]] = {
    "tdp_w": (1.0, 5_000.0),
    "power_limit_min_w": (1.0, 5_000.0),
    "power_limit_max_w": (1.0, 5_000.0),
    "sm_clock_max_mhz": (10, 10_000),
    "sm_clock_min_mhz": (10, 10_000),
    "resident_power_w": (0.0, 5_000.0),
    "prefill_power_min_frac": (0.0, 2.0),
    "prefill_power_max_frac": (0.0, 2.0),
    "prefill_power_ctx_tokens": (1.0, 1e7),
    "decode_power_base_frac": (0.0, 2.0),
    "decode_power_per_request_frac": (0.0, 1.0),
    "decode_power_max_frac": (0.0, 2.0),
    "prefill_mem_share": (0.0, 1.0),
    "decode_mem_share": (0.0, 1.0),
    "clock_power_exponent": (0.0, 5.0),
    "prefill_tokens_per_s": (1.0, 1e8),
    "prefill_clock_exponent": (0.0, 5.0),
    "decode_s_per_token": (1e-6, 10.0),
    "decode_batch_penalty": (0.0, 1.0),
    "decode_clock_exponent": (0.0, 5.0),
    "brake_sm_clock_mhz": (10, 10_000),
    "prefill_overshoot_frac": (0.0, 1.0),
}
"""Each GPU constant's physical range (clocks, in MHz, are whole numbers)."""
_WHOLE: Final = frozenset({"sm_clock_max_mhz", "sm_clock_min_mhz", "brake_sm_clock_mhz"})
_SERVER_BOUNDS: Final[dict[str, tuple[float, float]]] = {
    "provisioned_w": (100.0, 1e6),
    "other_w": (0.0, 1e6),
    "overhead_frac": (0.0, 2.0),
    "load_scale": (0.01, 1_000.0),
}
_ORDER: Final = (
    ("power_limit_min_w", "tdp_w"),
    ("tdp_w", "power_limit_max_w"),
    ("sm_clock_min_mhz", "sm_clock_max_mhz"),
    ("sm_clock_min_mhz", "brake_sm_clock_mhz"),
    ("brake_sm_clock_mhz", "sm_clock_max_mhz"),
    ("prefill_power_min_frac", "prefill_power_max_frac"),
    ("decode_power_base_frac", "decode_power_max_frac"),
    ("resident_power_w", "tdp_w"),
)


def _check_bounds(model: BaseModel, bounds: dict[str, tuple[float, float]]) -> None:
    for name, (lo, hi) in bounds.items():
        value = getattr(model, name).value
        if not lo <= value <= hi:
            msg = f"{name}: {value} is outside [{lo:g}, {hi:g}]"
            raise ValueError(msg)
        if name in _WHOLE and not float(value).is_integer():
            msg = f"{name}: {value} must be a whole number of MHz"
            raise ValueError(msg)


class GpuProfile(BaseModel):
    """One GPU type serving one model replica (``polca.sim.model.SimGpu``'s fields)."""

    model_config = _CONFIG

    tdp_w: Constant
    power_limit_min_w: Constant
    power_limit_max_w: Constant
    sm_clock_max_mhz: Constant
    sm_clock_min_mhz: Constant
    resident_power_w: Constant
    prefill_power_min_frac: Constant
    prefill_power_max_frac: Constant
    prefill_power_ctx_tokens: Constant
    decode_power_base_frac: Constant
    decode_power_per_request_frac: Constant
    decode_power_max_frac: Constant
    prefill_mem_share: Constant
    decode_mem_share: Constant
    clock_power_exponent: Constant
    prefill_tokens_per_s: Constant
    prefill_clock_exponent: Constant
    decode_s_per_token: Constant
    decode_batch_penalty: Constant
    decode_clock_exponent: Constant
    brake_sm_clock_mhz: Constant
    prefill_overshoot_frac: Constant

    @model_validator(mode="after")
    def _in_range_and_ordered(self) -> GpuProfile:
        _check_bounds(self, _GPU_BOUNDS)
        for low, high in _ORDER:
            if getattr(self, low).value > getattr(self, high).value:
                msg = f"{low} ({getattr(self, low).value}) must not exceed {high}"
                raise ValueError(msg)
        return self


class ServerProfile(BaseModel):
    """A server of such GPUs (``polca.sim.model.ServerPreset``'s fields)."""

    model_config = _CONFIG

    provisioned_w: Constant
    other_w: Constant
    overhead_frac: Constant
    load_scale: Constant

    @model_validator(mode="after")
    def _in_range(self) -> ServerProfile:
        _check_bounds(self, _SERVER_BOUNDS)
        return self


class SimProfile(BaseModel):
    """A whole profile file."""

    model_config = _CONFIG

    schema_version: Literal[1]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = Field("", max_length=2_000)
    gpu: GpuProfile
    server: ServerProfile

    def values(self) -> tuple[dict[str, float | int], dict[str, float | int]]:
        """The GPU's and the server's constants, by field name (sources left out)."""
        gpu = {name: getattr(self.gpu, name).value for name in GpuProfile.model_fields}
        server = {name: getattr(self.server, name).value for name in ServerProfile.model_fields}
        return gpu, server

    def sources(self) -> dict[str, str]:
        """Each constant's source, by field name (GPU and server fields alike)."""
        gpu = {name: getattr(self.gpu, name).source for name in GpuProfile.model_fields}
        server = {name: getattr(self.server, name).source for name in ServerProfile.model_fields}
        return gpu | server


def parse_model(
    model: type[ModelT], text: str, *, what: str, source: str, limits: yamlkit.YamlLimits
) -> ModelT:
    """Bounded YAML ``text`` validated as ``model``; errors are ``SimConfigError`` naming
    ``what`` (``profile``, ``published points``) and ``source``."""
    try:
        data = yamlkit.parse(text, source=source, limits=limits).data
    except yamlkit.YamlError as exc:
        msg = f"cannot read {what} {exc}"
        raise SimConfigError(msg) from exc
    return validated(model, data, what=what, source=source)


def validated(model: type[ModelT], data: object, *, what: str, source: str) -> ModelT:
    """``data`` (parsed YAML) as ``model``; every problem with its field in the error."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        msg = f"{what} {source} {'are' if what.endswith('s') else 'is'} invalid: {problems}"
        raise SimConfigError(msg) from exc


def parse_profile(text: str, *, source: str) -> SimProfile:
    """Validate profile YAML; ``source`` names it in the error (``SimConfigError``)."""
    return parse_model(SimProfile, text, what="profile", source=source, limits=PROFILE_LIMITS)


def load_model(model: type[ModelT], path: Path, *, what: str, limits: yamlkit.YamlLimits) -> ModelT:
    """The bounded YAML file at ``path`` validated as ``model`` (``parse_model``'s errors)."""
    data = yamlkit.load_file(path, what=what, error=SimConfigError, limits=limits)
    return validated(model, data, what=what, source=str(path))


def load_profile_file(path: Path) -> SimProfile:
    """Read and validate the profile at ``path``."""
    return load_model(SimProfile, path, what="profile", limits=PROFILE_LIMITS)


def shipped_profile_names() -> tuple[str, ...]:
    """The profiles that come with polca (``polca/data/profiles``), by name."""
    folder = resources.files("polca").joinpath("data", "profiles")
    return tuple(
        sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
    )


@functools.cache
def shipped_profile(name: str) -> SimProfile:
    """A shipped profile by name (``a100-sxm4``, ``h100-sxm``, ...; case-insensitive)."""
    key = name.strip().lower()
    if key not in shipped_profile_names():
        msg = f"no shipped profile {name!r}; shipped: {', '.join(shipped_profile_names())}"
        raise SimConfigError(msg)
    path = resources.files("polca").joinpath("data", "profiles", f"{key}.yaml")
    return parse_profile(path.read_text(encoding="utf-8"), source=f"polca/data/profiles/{key}.yaml")


def resolve_profile(spec: str) -> SimProfile:
    """``--profile``: a shipped profile's name, or the path of a profile file."""
    if spec.strip().lower() in shipped_profile_names():
        return shipped_profile(spec)
    path = Path(spec)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        return load_profile_file(path)
    shipped = ", ".join(shipped_profile_names())
    msg = f"no shipped profile {spec!r} and no such file; shipped: {shipped}"
    raise SimConfigError(msg)


def dump_profile(
    name: str,
    gpu: dict[str, float | int],
    server: dict[str, float | int],
    *,
    sources: dict[str, str],
    description: str = "",
) -> str:
    """A profile file's text (what ``bench/gpu_check.py`` writes); ``sources`` by field name,
    "default" for the ones not given. The result parses back to the same values."""
    import yaml  # noqa: PLC0415 - only when writing

    def section(values: dict[str, float | int]) -> dict[str, dict[str, object]]:
        return {
            key: {"value": value, "source": sources.get(key, "default (shipped profile)")}
            for key, value in values.items()
        }

    doc = {
        "schema_version": 1,
        "name": name,
        "description": description,
        "gpu": section(gpu),
        "server": section(server),
    }
    text = yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)
    parse_profile(text, source=f"profile {name}")  # what is written must load
    return text


__all__ = [
    "GpuProfile",
    "ServerProfile",
    "SimProfile",
    "dump_profile",
    "load_model",
    "load_profile_file",
    "parse_profile",
    "resolve_profile",
    "shipped_profile",
    "shipped_profile_names",
]
