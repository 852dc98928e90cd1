"""Rectified-flow samplers: the shifted flow-sigma schedule, UniPC multistep (bh2) and Euler.

Rectified flow interpolates ``x_σ = (1 − σ)·x0 + σ·ε``; the model predicts the velocity
``v = ε − x0``, so ``x0 = x_σ − σ·v``. Sampling walks σ from about 1 down to 0.

The schedule and the UniPC update reproduce diffusers' ``UniPCMultistepScheduler(use_flow_sigmas=True,
prediction_type="flow_prediction", flow_shift=s)`` (defaults ``solver_order=2``, ``solver_type="bh2"``,
``predict_x0=True``, ``lower_order_final=True``) step for step in fp32, and with ``use_karras_sigmas=True``
its Karras spacing of ``[sigma_min, sigma_max]`` mapped to flow sigmas (what Cosmos3 checkpoints ship,
see ``SchedulerSettings.from_diffusers``).

A sampler is per-request state: create one with :func:`make_sampler` for every request and call
:meth:`FlowSampler.step` once per step, in order. Several modalities (vision latents, actions, sound)
are stepped in lockstep by passing a dict of tensors; each key keeps its own history. This is what
diffusers' pipeline does with one scheduler copy per modality: the UniPC coefficients depend only on
the schedule and the step index and the update is elementwise, so per-key histories with shared
coefficients give the same numbers as separate scheduler copies (and as stepping a concatenation).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from policy_server.json_file import read_json
from policy_server.model.checkpoint import CheckpointError
from policy_server.pipeline.errors import InvalidSamplerSettings

NUM_TRAIN_TIMESTEPS = 1000
SAMPLER_NAMES = ("unipc", "euler")
MAX_SOLVER_ORDER = 3

# diffusers nudges a first sigma of exactly 1 down by this much: with α = 1 − σ the first UniPC
# update would otherwise take log(0).
_FIRST_SIGMA_EPS = 1e-6

Tensors = torch.Tensor | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class FlowSchedule:
    """The noise levels one request walks through.

    Attributes:
        sigmas: N + 1 noise levels, fp32 values, strictly decreasing, the last one exactly 0.
        timesteps: N model timesteps, ``int(σ_i · 1000)`` (truncated), what the timestep embedding sees.
    """

    sigmas: tuple[float, ...]
    timesteps: tuple[int, ...]

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


def flow_schedule(num_steps: int, shift: float, base_sigmas: list[float] | None = None) -> FlowSchedule:
    """Shifted flow sigmas as diffusers' ``set_timesteps`` builds them with ``use_flow_sigmas=True``.

    The base schedule is ``linspace(1, 1/1000, N + 1)[:-1]`` (or ``base_sigmas``, e.g. a distilled
    student's fixed list), shifted by ``σ' = s·σ / (1 + (s − 1)·σ)``; the final sigma is 0.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise InvalidSamplerSettings("num_steps", f"got {num_steps!r}; expected an integer >= 1")
    if not np.isfinite(shift) or shift <= 0:
        raise InvalidSamplerSettings("shift", f"got {shift!r}; expected a finite number > 0")
    if base_sigmas is None:
        base = np.linspace(1.0, 1.0 / NUM_TRAIN_TIMESTEPS, num_steps + 1)[:-1]
    else:
        base = np.asarray(base_sigmas, dtype=np.float64)
        if base.ndim != 1 or len(base) != num_steps:
            raise InvalidSamplerSettings(
                "base_sigmas", f"got shape {base.shape}; expected a list of num_steps={num_steps} values"
            )
        if not (np.all(base > 0) and np.all(base <= 1) and np.all(np.diff(base) < 0)):
            raise InvalidSamplerSettings(
                "base_sigmas", f"got {base.tolist()}; expected strictly decreasing values in (0, 1]"
            )
    shift = float(shift)
    sigmas = shift * base / (1 + (shift - 1) * base)
    if abs(sigmas[0] - 1) < _FIRST_SIGMA_EPS:
        sigmas[0] -= _FIRST_SIGMA_EPS
    timesteps = (sigmas * NUM_TRAIN_TIMESTEPS).astype(np.int64)
    sigmas_fp32 = np.append(sigmas, 0.0).astype(np.float32)
    return FlowSchedule(
        sigmas=tuple(float(s) for s in sigmas_fp32), timesteps=tuple(int(t) for t in timesteps)
    )


def karras_flow_schedule(num_steps: int, sigma_min: float, sigma_max: float, final_sigma: str = "zero") -> FlowSchedule:
    """Karras sigmas (rho 7) between ``sigma_max`` and ``sigma_min`` in EDM units, mapped to flow sigmas by
    ``σ / (σ + 1)``, as diffusers' UniPC builds them with ``use_karras_sigmas`` and ``use_flow_sigmas``
    (no flow shift is applied then). ``final_sigma``: ``"zero"``, or ``"sigma_min"`` to end on the last one."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise InvalidSamplerSettings("num_steps", f"got {num_steps!r}; expected an integer >= 1")
    if not (np.isfinite(sigma_min) and np.isfinite(sigma_max) and 0 < sigma_min < sigma_max):
        raise InvalidSamplerSettings(
            "sigma_min", f"got [{sigma_min!r}, {sigma_max!r}]; expected 0 < sigma_min < sigma_max"
        )
    rho = 7.0
    ramp = np.linspace(0, 1, num_steps)
    low, high = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    edm = (high + ramp * (low - high)) ** rho
    sigmas = edm / (edm + 1)
    timesteps = (sigmas * NUM_TRAIN_TIMESTEPS).astype(np.int64)
    last = 0.0 if final_sigma == "zero" else sigmas[-1]
    sigmas_fp32 = np.append(sigmas, last).astype(np.float32)
    return FlowSchedule(sigmas=tuple(float(s) for s in sigmas_fp32), timesteps=tuple(int(t) for t in timesteps))


class FlowSampler(ABC):
    """Per-request sampling state over one :class:`FlowSchedule`, all tensors fp32.

    ``step(velocity, sample)`` takes the model velocity at ``sigmas[i]`` and the sample it was
    evaluated on and returns the sample at ``sigmas[i + 1]``. Both may be one tensor or a dict of
    tensors (one entry per modality, same keys on every step); the result has the same form.
    """

    name: str

    def __init__(self, schedule: FlowSchedule) -> None:
        self.schedule = schedule
        self._sigmas_fp32 = torch.tensor(schedule.sigmas, dtype=torch.float32)
        self._sigma_values = tuple(self._sigmas_fp32.tolist())  # exactly the fp32 values, hashable
        self._step_index = 0
        self._keys: tuple[str, ...] | None = None

    @property
    def sigmas(self) -> list[float]:
        """N + 1 noise levels, the last one 0."""
        return list(self.schedule.sigmas)

    @property
    def timesteps(self) -> list[int]:
        """N model timesteps (σ·1000, truncated to int)."""
        return list(self.schedule.timesteps)

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps

    @property
    def step_index(self) -> int:
        """Number of steps taken so far, i.e. the index of the next step."""
        return self._step_index

    def step(self, velocity: Tensors, sample: Tensors, *, step_index: int | None = None) -> Tensors:
        """Advance one step. ``step_index``, when given, must equal :attr:`step_index` (a guard
        against a loop that skipped or repeated a call)."""
        single = isinstance(velocity, torch.Tensor)
        velocities = {"": velocity} if single else dict(velocity)
        samples = {"": sample} if isinstance(sample, torch.Tensor) else dict(sample)
        keys = tuple(sorted(velocities))
        if tuple(sorted(samples)) != keys:
            raise ValueError(f"velocity keys {keys} and sample keys {tuple(sorted(samples))} differ")
        i = self._next_step(keys, step_index)
        for key in keys:
            if velocities[key].shape != samples[key].shape:
                raise ValueError(
                    f"velocity {key!r} has shape {tuple(velocities[key].shape)} but sample has "
                    f"{tuple(samples[key].shape)}"
                )
        out = self._step(
            {k: velocities[k].float() for k in keys}, {k: samples[k].float() for k in keys}, i
        )
        self._step_index += 1
        return out[""] if single else out

    def _next_step(self, keys: tuple[str, ...], step_index: int | None = None) -> int:
        """The index of the step about to be taken with modalities `keys`, checked."""
        i = self._step_index
        if i >= self.num_steps:
            raise RuntimeError(f"all {self.num_steps} steps of this sampler are done; create a new one")
        if step_index is not None and step_index != i:
            raise RuntimeError(f"step_index={step_index} given, but this sampler is at step {i}")
        if self._keys is None:
            self._keys = keys
        elif keys != self._keys:
            raise ValueError(f"modalities changed from {self._keys} to {keys}; keep the same keys every step")
        return i

    @abstractmethod
    def _step(
        self, velocities: dict[str, torch.Tensor], samples: dict[str, torch.Tensor], i: int
    ) -> dict[str, torch.Tensor]: ...


class EulerSampler(FlowSampler):
    """First-order flow update ``x_{i+1} = x_i + (σ_{i+1} − σ_i)·v_i``."""

    name = "euler"

    def _step(self, velocities, samples, i):
        # The step size is formed in fp32, as the sample is.
        dt = float(self._sigmas_fp32[i + 1] - self._sigmas_fp32[i])
        return {k: samples[k] + dt * velocities[k] for k in samples}


@dataclass(frozen=True)
class UniCoefficients:
    """Scalars of one UniPC (bh) update from ``σ_s0`` to ``σ_t`` (fp32 values held as floats).

    ``x_t = x_scale·x − m0_scale·m0 − res_scale·(Σ_j rhos[j]·D1_j [+ rhos[-1]·(m_t − m0)])`` where
    ``D1_j = (m_j − m0) / rks[j]`` are scaled differences of earlier x0 predictions.
    """

    x_scale: float
    m0_scale: float
    res_scale: float
    rks: tuple[float, ...]
    rhos: tuple[float, ...]


def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """λ = log(α) − log(σ) with the flow parameterisation α = 1 − σ (fp32, +inf at σ = 0)."""
    return torch.log(1 - sigma) - torch.log(sigma)


@functools.lru_cache(maxsize=4096)
def _cached_uni_coefficients(sigmas: tuple[float, ...], t: int, s0: int, history: tuple[int, ...],
                             corrector: bool) -> UniCoefficients:
    """`_uni_coefficients` of a schedule given as its fp32 values: they depend on nothing else, and every tick
    of a step count uses the same ones."""
    return _uni_coefficients(torch.tensor(sigmas, dtype=torch.float32), t, s0, list(history), corrector)


def _uni_coefficients(
    sigmas: torch.Tensor, t: int, s0: int, history: list[int], corrector: bool
) -> UniCoefficients:
    """UniPC bh2 coefficients, computed in fp32 in the same order as diffusers so results match.

    Args:
        sigmas: fp32 schedule ``[N + 1]``.
        t, s0: indices of the target and the current noise level.
        history: indices of the earlier x0 predictions used (most recent first), ``order − 1`` of them.
        corrector: True for UniC, whose last rho weights the fresh prediction at ``t``.
    """
    sigma_t, sigma_s0 = sigmas[t], sigmas[s0]
    alpha_t = 1 - sigma_t
    lambda_s0 = _log_snr(sigma_s0)
    h = _log_snr(sigma_t) - lambda_s0
    rks = [(_log_snr(sigmas[si]) - lambda_s0) / h for si in history]
    order = len(history) + 1

    hh = -h  # predict_x0 form
    h_phi_1 = torch.expm1(hh)
    b_h = torch.expm1(hh)  # bh2
    h_phi_k = h_phi_1 / hh - 1
    factorial = 1
    b = []
    for k in range(1, order + 1):
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    rks_all = torch.stack([*rks, torch.ones(())])
    r_matrix = torch.stack([torch.pow(rks_all, k - 1) for k in range(1, order + 1)])
    b_vec = torch.stack(b)

    if corrector:
        # Order 1 uses the trapezoid weight 0.5, as diffusers does.
        rhos = torch.tensor([0.5]) if order == 1 else torch.linalg.solve(r_matrix, b_vec)
    elif order == 1:
        rhos = torch.zeros(0)
    elif order == 2:
        rhos = torch.tensor([0.5])
    else:
        rhos = torch.linalg.solve(r_matrix[:-1, :-1], b_vec[:-1])
    return UniCoefficients(
        x_scale=float(sigma_t / sigma_s0),
        m0_scale=float(alpha_t * h_phi_1),
        res_scale=float(alpha_t * b_h),
        rks=tuple(float(r) for r in rks),
        rhos=tuple(float(r) for r in rhos),
    )


class UniPCSampler(FlowSampler):
    """UniPC multistep predictor-corrector (bh2, x0 form) on flow sigmas.

    Step i: turn the velocity into ``x0 = x − σ_i·v``; if i > 0, correct the sample the model saw
    (UniC, using the new x0); then predict the next sample from the last ``order`` x0 predictions
    (UniP). The order warms up from 1 and falls back to 1 on the final step (``lower_order_final``),
    where σ = 0 makes the update return the x0 prediction itself.
    """

    name = "unipc"

    def __init__(self, schedule: FlowSchedule, solver_order: int = 2) -> None:
        super().__init__(schedule)
        if solver_order not in range(1, MAX_SOLVER_ORDER + 1):
            raise InvalidSamplerSettings(
                "solver_order", f"got {solver_order!r}; expected an integer in [1, {MAX_SOLVER_ORDER}]"
            )
        self.solver_order = solver_order
        self._x0_history: dict[str, list[torch.Tensor]] = {}  # most recent last, at most solver_order
        self._last_sample: dict[str, torch.Tensor] = {}  # sample the previous predictor started from
        self._last_order = 0  # order of the previous predictor; the next corrector uses the same
        self._warm_steps = 0

    def step_with(self, update: Callable[..., tuple], sample: torch.Tensor) -> tuple:
        """Advance the one tensor `sample` a step, as `step` would given its velocity, by `update`, which decodes
        the velocity itself: `update(sample, sigma, history, last_sample, corrector, predictor)` (the arguments of
        `unipc_update` after the velocity) returns the x0 prediction and the corrected sample, as `unipc_update`
        does, then what this returns (what it makes of the predicted sample, and more)."""
        i = self._next_step(("",))
        corrector, predictor = self._coefficients(i)
        results = self._update("", sample, i, corrector, predictor, update)
        self._end_step(predictor)
        self._step_index += 1
        return results

    def _step(self, velocities, samples, i):
        corrector, predictor = self._coefficients(i)
        out = {k: self._update(k, samples[k], i, corrector, predictor,
                               functools.partial(unipc_update, velocities[k]))[0] for k in samples}
        self._end_step(predictor)
        return out

    def _coefficients(self, i: int) -> tuple[UniCoefficients | None, UniCoefficients]:
        """Step i's corrector (None on the first step) and predictor."""
        corrector = None
        if i > 0:
            corrector = _cached_uni_coefficients(
                self._sigma_values, t=i, s0=i - 1,
                history=tuple(i - 1 - j for j in range(1, self._last_order)), corrector=True,
            )
        order = min(self.solver_order, self.num_steps - i, self._warm_steps + 1)
        predictor = _cached_uni_coefficients(
            self._sigma_values, t=i + 1, s0=i, history=tuple(i - j for j in range(1, order)), corrector=False
        )
        return corrector, predictor

    def _update(self, key: str, sample: torch.Tensor, i: int, corrector: UniCoefficients | None,
                predictor: UniCoefficients, update: Callable[..., tuple]) -> list:
        """Run `update` (`step_with`'s) on modality `key` at step i and keep its x0 and corrected sample."""
        history = self._x0_history.setdefault(key, [])
        x0, self._last_sample[key], *results = update(sample, self._sigma_values[i], tuple(history),
                                                      self._last_sample.get(key), corrector, predictor)
        history.append(x0)
        del history[: -self.solver_order]
        return results

    def _end_step(self, predictor: UniCoefficients) -> None:
        self._last_order = len(predictor.rks) + 1
        self._warm_steps = min(self._warm_steps + 1, self.solver_order)


def unipc_update(velocity: torch.Tensor, sample: torch.Tensor, sigma: float, history: tuple[torch.Tensor, ...],
                 last_sample: torch.Tensor | None, corrector: UniCoefficients | None, predictor: UniCoefficients
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One UniPC step of one tensor at noise level `sigma`: the x0 prediction, the sample corrected with it
    (UniC from `last_sample`, the sample the previous predictor started from; the sample itself without a
    `corrector`) and the next sample predicted from it (UniP). `history`: the earlier x0 predictions, most recent
    last. The scalars may be floats or 0-dim fp32 tensors (a compiled update's): the arithmetic is the same."""
    x0 = sample - sigma * velocity
    if corrector is not None:
        sample = _corrected(corrector, history, last_sample, x0)
    return x0, sample, _predicted(predictor, (*history, x0), sample)


def widest_update(order: int, sample: torch.Tensor, history: tuple[torch.Tensor, ...],
                  last_sample: torch.Tensor | None, corrector: UniCoefficients | None, predictor: UniCoefficients
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, UniCoefficients, UniCoefficients]:
    """`unipc_update`'s `history`, `last_sample`, `corrector` and `predictor` of a step of a sampler of `order`
    in the widest form its steps take: `order` earlier predictions, a corrector and a predictor of that order.
    `unipc_update` gives the same tensors bit for bit from either form: a term the step lacks gets weight zero
    on a finite difference (0 * d adds an exact zero), and the first step, which corrects nothing, gets the
    corrector that returns the sample it is given (1 * x - 0 * m0 - 0 * c). One traced update (`tick_work.py`)
    then serves every step."""
    padding = (sample,) * (order - len(history))  # any finite tensor: its differences weigh zero
    if corrector is None:
        corrector, last_sample = UniCoefficients(1.0, 0.0, 0.0, (), (0.0,)), sample
    return ((*padding, *history), last_sample, _widened(corrector, order, corrector=True),
            _widened(predictor, order, corrector=False))


def _widened(coef: UniCoefficients, order: int, corrector: bool) -> UniCoefficients:
    """`coef` with `order - 1` rks (the added ones 1, any nonzero would do) and zero weights on the added
    differences; a corrector's last rho, which weighs the fresh prediction, stays last."""
    missing = order - 1 - len(coef.rks)
    differences, fresh = (coef.rhos[:-1], coef.rhos[-1:]) if corrector else (coef.rhos, ())
    return UniCoefficients(coef.x_scale, coef.m0_scale, coef.res_scale, (*coef.rks, *(1.0,) * missing),
                           (*differences, *(0.0,) * missing, *fresh))


def _differences(coef: UniCoefficients, history: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """``D1_j = (m_j − m0) / r_j`` for the earlier predictions, most recent first."""
    m0 = history[-1]
    return [(history[-(j + 2)] - m0) / rk for j, rk in enumerate(coef.rks)]


def _predicted(coef: UniCoefficients, history: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    m0 = history[-1]
    x_t = coef.x_scale * x - coef.m0_scale * m0
    diffs = _differences(coef, history)
    if diffs:
        x_t = x_t - coef.res_scale * _weighted_sum(coef.rhos, diffs)
    return x_t


def _corrected(coef: UniCoefficients, history: tuple[torch.Tensor, ...], x: torch.Tensor, x0_t: torch.Tensor
               ) -> torch.Tensor:
    m0 = history[-1]
    x_t = coef.x_scale * x - coef.m0_scale * m0
    correction = coef.rhos[-1] * (x0_t - m0)
    diffs = _differences(coef, history)
    if diffs:
        correction = _weighted_sum(coef.rhos[:-1], diffs) + correction
    return x_t - coef.res_scale * correction


def _weighted_sum(weights: tuple[float, ...], tensors: list[torch.Tensor]) -> torch.Tensor:
    total = weights[0] * tensors[0]
    for w, t in zip(weights[1:], tensors[1:], strict=True):
        total = total + w * t
    return total


def make_sampler(
    name: str,
    num_steps: int,
    shift: float,
    *,
    solver_order: int = 2,
    base_sigmas: list[float] | None = None,
    karras: tuple[float, float, str] | None = None,
) -> FlowSampler:
    """A fresh per-request sampler.

    Args:
        name: ``"unipc"`` or ``"euler"``.
        num_steps: N denoising steps (model evaluations per CFG branch).
        shift: flow shift s (Cosmos3 defaults: 10 for policy/dynamics, 5 for DROID serving, 3 for 256p).
        solver_order: UniPC order (diffusers default 2); ignored by Euler.
        base_sigmas: optional unshifted schedule of N values in (0, 1] instead of the linspace.
        karras: ``(sigma_min, sigma_max, final_sigma)`` for the Karras flow schedule instead of the shifted
            one (``shift`` and ``base_sigmas`` are then unused, as in diffusers).
    """
    schedule = karras_flow_schedule(num_steps, *karras) if karras else flow_schedule(num_steps, shift, base_sigmas)
    if name == "unipc":
        return UniPCSampler(schedule, solver_order=solver_order)
    if name == "euler":
        return EulerSampler(schedule)
    raise InvalidSamplerSettings(
        "sampler", f"unknown sampler {name!r}; expected one of {', '.join(SAMPLER_NAMES)}"
    )


# diffusers' defaults for the UniPCMultistepScheduler fields whose other values this module does not implement.
_UNIPC_REQUIRED = {
    "use_flow_sigmas": (False, True),
    "prediction_type": ("epsilon", "flow_prediction"),
    "solver_type": ("bh2", "bh2"),
    "predict_x0": (True, True),
    "lower_order_final": (True, True),
    "thresholding": (False, False),
    "use_dynamic_shifting": (False, False),
    "use_exponential_sigmas": (False, False),
    "use_beta_sigmas": (False, False),
    "shift_terminal": (None, None),
    "num_train_timesteps": (1000, NUM_TRAIN_TIMESTEPS),
    "disable_corrector": ([], []),  # the steps diffusers skips UniC after; this sampler corrects after every one
    "solver_p": (None, None),
}


def scheduler_settings(path: str | Path) -> dict[str, object]:
    """`PolicyConfig` sampler fields from a diffusers ``scheduler_config.json`` (a flow-prediction
    ``UniPCMultistepScheduler``, as Cosmos3 pipelines save it). Raises CheckpointError naming the field
    whose value this sampler does not implement."""
    path = Path(path)
    config = read_json(path, CheckpointError)
    if not isinstance(config, dict) or config.get("_class_name") != "UniPCMultistepScheduler":
        got = config.get("_class_name") if isinstance(config, dict) else type(config).__name__
        raise CheckpointError(f"{path}: _class_name {got!r}; expected 'UniPCMultistepScheduler'")
    for key, (default, wanted) in _UNIPC_REQUIRED.items():
        if config.get(key, default) != wanted:
            raise CheckpointError(f"{path}: {key}={config.get(key, default)!r}; this server implements {wanted!r}")
    order = config.get("solver_order", 2)
    if not isinstance(order, int) or isinstance(order, bool) or not 1 <= order <= MAX_SOLVER_ORDER:
        raise CheckpointError(f"{path}: solver_order={order!r}; expected 1..{MAX_SOLVER_ORDER}")
    final = config.get("final_sigmas_type", "zero")
    if final not in ("zero", "sigma_min"):
        raise CheckpointError(f"{path}: final_sigmas_type={final!r}; expected 'zero' or 'sigma_min'")
    shift = config.get("flow_shift", 1.0)
    if not isinstance(shift, int | float) or isinstance(shift, bool) or not 0 < shift < math.inf:
        raise CheckpointError(f"{path}: flow_shift={shift!r}; expected a number above 0")
    settings: dict[str, object] = {"sampler": "unipc", "solver_order": order, "final_sigma": final,
                                   "shift": float(shift)}
    karras = config.get("use_karras_sigmas", False)
    if not isinstance(karras, bool):  # diffusers tests its truth: the string "false" would pick Karras sigmas
        raise CheckpointError(f"{path}: use_karras_sigmas={karras!r}; expected true or false")
    if karras:
        low, high = config.get("sigma_min"), config.get("sigma_max")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)) \
                or not 0 < low < high < math.inf:
            raise CheckpointError(f"{path}: use_karras_sigmas needs 0 < sigma_min < sigma_max < infinity, got "
                                  f"{low!r}, {high!r}")
        settings.update(sigma_schedule="karras", sigma_min=float(low), sigma_max=float(high))
    elif final != "zero":
        raise CheckpointError(
            f"{path}: final_sigmas_type={final!r} with flow-shifted sigmas; this server implements 'zero'"
        )
    return settings
