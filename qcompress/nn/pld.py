"""Progressive layer dropping (PLD; Zhang & He 2020, DeepSpeed's `progressive_layer_drop`).

While training, each repeated block of a transformer stack is skipped at random: a dropped block
passes its input through unchanged. Block l of L (l = 1 is the first) is kept with probability

    p_l(t) = 1 - (l / L) * (1 - theta(t)),   theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar

so dropping grows with depth and over training (the PLD paper's schedule; theta(t) is DeepSpeed's,
updated at every optimizer boundary with the step count before it moves, so optimizer step g
trains with theta(g - 1)). In eval nothing is dropped. With `rescale` (default, as DeepSpeed's PLD
BERT), a kept block's change to its input is divided by p_l, so the expected training output equals
the eval output.

The decisions come from a counter-based hash of (seed, optimizer step, block, call within the
step), never from torch's RNG: every rank drops the same blocks, dropout streams are untouched,
and a resumed run replays the decisions exactly. Blocks change class in place (a subclass of their
own class), so parameters keep their identity and state_dict keys.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError

_MASK64 = (1 << 64) - 1
_KEEP_KW = "_qc_pld_keep"  # the decision travels as a keyword, so activation-checkpoint replays reuse it


def theta_at(step: float, theta_bar: float, gamma: float) -> float:
    """DeepSpeed's schedule: (1 - theta_bar) * exp(-gamma * step) + theta_bar."""
    return (1.0 - theta_bar) * math.exp(-gamma * step) + theta_bar


def keep_probability(depth: int, num_blocks: int, theta: float) -> float:
    """Keep probability of block `depth` (1-based) of `num_blocks` when the schedule is at theta."""
    return 1.0 - depth / num_blocks * (1.0 - theta)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int, block: int, call: int) -> float:
    """A number in [0, 1) that depends only on its arguments (the same on every rank and run)."""
    h = _mix64(seed & _MASK64)
    for v in (step, block, call):
        h = _mix64((h + 0x9E3779B97F4A7C15 + (v & _MASK64)) & _MASK64)
    return (h >> 11) / float(1 << 53)


class PLDSchedule:
    """The shared state of a model's droppable blocks: theta now and the per-step counters.

    `start_step(g)` is called with the number of optimizer steps done (the engine does it at every
    boundary and on resume); everything else follows from g, so checkpoints need nothing extra.
    """

    def __init__(self, theta: float, gamma: float, seed: int = 0, rescale: bool = True):
        self.theta_bar, self.gamma, self.seed, self.rescale = float(theta), float(gamma), int(seed), bool(rescale)
        self.step = 0
        self.theta = 1.0  # DeepSpeed's current_theta before the first boundary
        self.blocks: List["PLDState"] = []
        self._calls: Dict[int, int] = {}  # block id -> training calls in this step
        self._kept = self._run = 0
        self.last_share = 1.0  # share of block calls that ran in the last finished step

    def start_step(self, global_steps: int, resumed: bool = False) -> None:
        if not resumed and self._run:
            self.last_share = self._kept / self._run
        elif resumed:
            self.last_share = 1.0
        self.step = int(global_steps)
        self.theta = theta_at(max(self.step - 1, 0), self.theta_bar, self.gamma)
        self._calls.clear()
        self._kept = self._run = 0

    # DeepSpeed's ProgressiveLayerDrop API, for loops without the engine
    def update_state(self, global_step: int) -> None:
        """DeepSpeed's call at an accumulation boundary, with the step count before it moves."""
        self.start_step(int(global_step) + 1)

    def get_theta(self) -> float:
        return self.theta

    def keep_probabilities(self) -> Dict[str, float]:
        """{block name: keep probability now}."""
        return {b.name: b.keep_probability() for b in self.blocks}

    def decide(self, block: "PLDState") -> float:
        """0.0 to drop this call of `block`, else its keep probability (counts the call)."""
        call = self._calls.get(block.index, 0)
        self._calls[block.index] = call + 1
        p = block.keep_probability()
        keep = p >= 1.0 or uniform(self.seed, self.step, block.index, call) < p
        self._run += 1
        self._kept += int(keep)
        return p if keep else 0.0


class PLDState:
    """What a droppable block knows: its place in its stack and the shared schedule."""

    def __init__(self, schedule: PLDSchedule, name: str, index: int, depth: int, stack_size: int):
        self.schedule, self.name = schedule, name
        self.index = index  # position among all the model's blocks (hash key)
        self.depth, self.stack_size = depth, stack_size  # 1-based depth within its stack

    def keep_probability(self) -> float:
        return keep_probability(self.depth, self.stack_size, self.schedule.theta)


def _hidden_input(args, kwargs, name: str) -> torch.Tensor:
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("src", kwargs.get("x")))
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"progressive_layer_drop: block {name!r} got no hidden-state tensor as its first "
            "argument (or hidden_states=...), so it cannot pass its input through"
        )
    return x


class PLDBlock:
    """Mixin placed before a block's own class. __call__ draws the decision outside any activation
    checkpoint (Hugging Face checkpoints `forward`), so the recompute in backward replays it."""

    def __call__(self, *args, **kwargs):
        st = self.__dict__.get("qc_pld")
        if st is not None and self.training:
            kwargs[_KEEP_KW] = st.schedule.decide(st)
        return super().__call__(*args, **kwargs)

    def forward(self, *args, **kwargs):
        keep = kwargs.pop(_KEEP_KW, None)
        if keep is None:
            return super().forward(*args, **kwargs)
        st = self.__dict__["qc_pld"]
        x = _hidden_input(args, kwargs, st.name)
        if keep == 0.0:
            return x
        y = super().forward(*args, **kwargs)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            raise TypeError(
                f"progressive_layer_drop: block {st.name!r} ({base_block_class(type(self)).__name__}) "
                f"returns {type(y).__name__}, not a tensor shaped like its input, so a dropped "
                "block cannot stand in for it; name other blocks with progressive_layer_drop.modules"
            )
        if st.schedule.rescale and keep < 1.0:
            y = x + (y - x) / keep
        return y

    def __reduce_ex__(self, protocol):
        """Pickle by base class: the PLD class is made at run time (see nn.layers for the same)."""
        rv = super().__reduce_ex__(protocol)
        base = base_block_class(type(self))
        if not isinstance(rv, tuple) or _CLASSES.get(base) is not type(self):
            return rv
        return (_new_pld_block, (base,)) + tuple(rv[2:])


_CLASSES: Dict[type, type] = {}


def pld_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"PLD{cls.__name__}", (PLDBlock, cls), {"__module__": __name__})
    return _CLASSES[cls]


def base_block_class(cls: type) -> type:
    return [c for c in cls.__mro__[1:] if not issubclass(c, PLDBlock)][0]


def _new_pld_block(base: type):
    cls = pld_class(base)
    return cls.__new__(cls)


# --- which modules are blocks ----------------------------------------------------------------


def _is_block(module: nn.Module) -> bool:
    """A transformer-style block: at least two sub-modules that hold parameters."""
    return sum(1 for c in module.children() if any(True for _ in c.parameters())) >= 2


def auto_blocks(model: nn.Module) -> List[List[Tuple[str, nn.Module]]]:
    """The repeated blocks of each stack: ModuleLists of >= 2 same-class blocks (BERT's
    encoder.layer, GPT-2's h, Llama's layers, nn.TransformerEncoder's layers), outermost only."""
    stacks, inside = [], set()
    for name, mod in model.named_modules():
        if any(name.startswith(p) for p in inside):
            continue
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            items = list(mod.named_children())
            if len({type(m) for _, m in items}) == 1 and all(_is_block(m) for _, m in items):
                stacks.append([(f"{name}.{n}" if name else n, m) for n, m in items])
                inside.add(f"{name}." if name else "")
    return stacks


def matched_blocks(model: nn.Module, patterns: Sequence[str]) -> List[List[Tuple[str, nn.Module]]]:
    """Modules whose dotted name any regex re.search-es, as stacks (one per parent module)."""
    hits = [(n, m) for n, m in model.named_modules() if n and any(re.search(p, n) for p in patterns)]
    for i, pattern in enumerate(patterns):
        if not any(re.search(pattern, n) for n, _ in hits):
            raise ConfigError(f"progressive_layer_drop.modules[{i}]", f"{pattern!r} matches no module")
    names = [n for n, _ in hits]
    for n in names:
        outer = next((o for o in names if n.startswith(o + ".")), None)
        if outer is not None:
            raise ConfigError(
                "progressive_layer_drop.modules",
                f"{n!r} lies inside {outer!r}, which is "
                "also selected; a block cannot be dropped inside a dropped block",
            )
    stacks: Dict[str, List[Tuple[str, nn.Module]]] = {}
    for n, m in hits:
        stacks.setdefault(n.rpartition(".")[0], []).append((n, m))
    return list(stacks.values())


def apply_pld(model: nn.Module, pld_cfg) -> Optional[PLDSchedule]:
    """Make the blocks droppable (in place) per the config's progressive_layer_drop section.
    Returns the shared schedule, or None when PLD is off. Applying it twice is an error."""
    if not pld_cfg.enabled:
        return None
    if pld_schedule(model) is not None:
        raise ValueError("progressive_layer_drop is already applied to this model")
    stacks = matched_blocks(model, pld_cfg.modules) if pld_cfg.modules else auto_blocks(model)
    if not stacks:
        raise ConfigError(
            "progressive_layer_drop.modules",
            f"no repeated blocks found in {type(model).__name__} "
            "(looked for ModuleLists of same-class blocks); name them with a regex, e.g. "
            '["encoder\\\\.layer\\\\.\\\\d+$"]',
        )
    sched = PLDSchedule(pld_cfg.theta, pld_cfg.gamma, pld_cfg.seed, pld_cfg.rescale)
    for stack in stacks:
        for depth, (name, mod) in enumerate(stack, start=1):
            state = PLDState(sched, name, len(sched.blocks), depth, len(stack))
            mod.__class__ = pld_class(type(mod))
            mod.__dict__["qc_pld"] = state  # not a sub-module: nothing new in state_dict
            sched.blocks.append(state)
    return sched


def pld_schedule(model: nn.Module) -> Optional[PLDSchedule]:
    """The model's PLD schedule, or None when no block is droppable."""
    for m in model.modules():
        st = m.__dict__.get("qc_pld")
        if st is not None:
            return st.schedule
    return None


def remove_pld(model: nn.Module) -> nn.Module:
    """Give every droppable block its own class back (what it computes in eval is unchanged)."""
    for m in model.modules():
        if isinstance(m, PLDBlock):
            m.__dict__.pop("qc_pld", None)
            m.__class__ = base_block_class(type(m))
    return model
