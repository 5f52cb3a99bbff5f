"""Schema of DeepSpeed's top-level `compile` section: the engine runs the model through torch.compile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from ..errors import ConfigError
from .schema import field, join

# torch.compile's keyword arguments besides `backend` (its signature in torch 2.4 to 2.13)
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options", "disable")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class Compile:
    """DeepSpeed's keys and defaults (enabled false, backend inductor, kwargs {}); `deepcompile`
    (DeepSpeed's own ZeRO graph passes) is accepted only as false."""

    enabled: bool = field(False, doc="the engine compiles the model in place (Module.compile)")
    backend: str = field("inductor", doc="a torch.compile backend name (torch._dynamo.list_backends())")
    kwargs: Dict[str, Any] = field({}, doc="more torch.compile arguments: fullgraph, dynamic, mode, options")
    deepcompile: bool = field(False, doc="DeepSpeed's DeepCompile passes: not implemented, only false")

    def _validate(self, path):
        for key, value in self.kwargs.items():
            if key not in COMPILE_KWARGS:
                from .schema import did_you_mean

                raise ConfigError(
                    join(join(path, "kwargs"), key),
                    f"is not a torch.compile argument; allowed: "
                    f"{', '.join(COMPILE_KWARGS)}{did_you_mean(key, COMPILE_KWARGS)}",
                )
            if key == "mode" and value not in MODES:
                raise ConfigError(
                    join(path, "kwargs.mode"),
                    f"{value!r} is not a torch.compile mode; choose one of {', '.join(MODES)}",
                )
            if key in ("fullgraph", "disable") and not isinstance(value, bool):
                raise ConfigError(join(path, f"kwargs.{key}"), f"expected true or false, got {value!r}")
            if key == "dynamic" and value is not None and not isinstance(value, bool):
                raise ConfigError(join(path, "kwargs.dynamic"), f"expected true, false or null, got {value!r}")
            if key == "options" and not isinstance(value, dict):
                raise ConfigError(
                    join(path, "kwargs.options"), f"expected a mapping of inductor options, got {value!r}"
                )
        if "mode" in self.kwargs and "options" in self.kwargs:
            raise ConfigError(join(path, "kwargs.options"), "torch.compile takes mode or options, not both")
        if self.deepcompile:
            raise ConfigError(
                join(path, "deepcompile"),
                "DeepSpeed's DeepCompile (its ZeRO graph passes) is not "
                "implemented; ZeRO runs on DDP / FSDP2 and the model compiles with enabled: true",
            )
        if not self.backend:
            raise ConfigError(join(path, "backend"), "names no backend; use e.g. inductor, aot_eager or eager")
