"""The distributed optimizer with expert parallelism: two shardings, one optimizer.

A rank's routed experts (expert parallelism, `allreduce=False`) are replicated
only over its expert-data-parallel group, the dense weights over the whole
data-parallel group, so, as Megatron-Core builds separate expert buffers, the
experts get a `DistributedOptimizer` of their own sharded over the
expert-data-parallel group and the dense weights the usual one. Both average
by the data-parallel size (Megatron's expert_gradient_scaling_factor: an
expert's gradient already sums its EP group's tokens). The gradient norm adds
the dense squares to the experts' summed over the EP group and the pipeline
stages; an inf/NaN anywhere skips the step everywhere. The trainer drives it
as it drives one `DistributedOptimizer`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.expert_parallel import is_expert_parameter


class ExpertParallelDistributedOptimizer:
    """A dense `DistributedOptimizer` over `dp_group` and an expert one over
    `expert_dp_group`; `param_groups` lists the dense groups, then the expert ones."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        *,
        dp_group: dist.ProcessGroup | None,
        expert_dp_group: dist.ProcessGroup | None,
        ep_group: dist.ProcessGroup | None,
        pipeline_group: dist.ProcessGroup | None = None,
        **options: Any,
    ) -> None:
        def part(experts: bool) -> list[dict[str, Any]]:
            return [
                {**g, "params": [p for p in g["params"] if is_expert_parameter(p) == experts]}
                for g in param_groups
            ]

        dp = dist.get_world_size(dp_group)
        self.dense = DistributedOptimizer(
            part(False), make_optimizer, dp_group=dp_group, pipeline_group=pipeline_group, **options
        )
        expert_groups = part(True)
        self.experts = (
            DistributedOptimizer(
                expert_groups,
                make_optimizer,
                dp_group=expert_dp_group,
                grad_divisor=dp,
                **{k: v for k, v in options.items() if k not in ("tied_weight", "tied_group")},
            )
            if any(g["params"] for g in expert_groups)
            else None  # a pipeline stage without MoE layers
        )
        self._ep_group = ep_group
        self._pipeline_group = pipeline_group

    @property
    def _parts(self) -> list[DistributedOptimizer]:
        return [self.dense] + ([self.experts] if self.experts is not None else [])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every inner group (the LR scheduler sets `lr` in each)."""
        return [g for part in self._parts for g in part.param_groups]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self._parts:
                stack.enter_context(part.no_sync())
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self._parts:
            part.zero_grad(set_to_none)

    def finish_grad_sync(self) -> None:
        for part in self._parts:
            part.finish_grad_sync()

    def unscale_and_check(self, scale: float) -> bool:
        found = torch.tensor(
            float(any([part.unscale_and_check(scale) for part in self._parts])),
            device=self.dense.params[0].device,
        )
        dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank skips alike
        return bool(found > 0)

    def clip_grad_norm(self, max_norm: float) -> float:
        dense = self.dense.grad_norm_squares().sum()
        experts = (
            self.experts.grad_norm_squares().sum()
            if self.experts is not None
            else torch.zeros_like(dense)
        )
        dist.all_reduce(experts, group=self._ep_group)  # this stage's experts
        if self._pipeline_group is not None:
            dist.all_reduce(experts, group=self._pipeline_group)
        norm = float((dense + experts).sqrt())
        if not math.isfinite(norm):
            return float("nan")
        if max_norm > 0:
            for part in self._parts:
                part.scale_grads(min(max_norm / (norm + 1e-6), 1.0))
        return norm

    def step(self) -> None:
        for part in self._parts:
            part.step()

    def finish_param_sync(self) -> None:
        for part in self._parts:
            part.finish_param_sync()

    def reload_model_params(self) -> None:
        for part in self._parts:
            part.reload_model_params()

    # --- torch_dist checkpoints: one state, indexed dense parameters first, then experts

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self._parts for p in part.params]

    def group_members(self) -> list[list[int]]:
        """Per parameter group of the model, its members' indices (dense, then experts)."""
        members = self.dense.group_members()
        if self.experts is not None:
            offset = len(self.dense.params)
            for mine, theirs in zip(members, self.experts.group_members(), strict=True):
                mine.extend(offset + i for i in theirs)
        return members

    def _joined(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        state, offset = {}, 0
        for part, sharded in zip(self._parts, parts, strict=True):
            state.update({offset + i: entry for i, entry in sharded["state"].items()})
            offset += len(part.params)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": members}
            for g, members in zip(parts[0]["param_groups"], self.group_members(), strict=True)
        ]
        return {"state": state, "param_groups": groups}

    def sharded_state(self) -> dict[str, Any]:
        """`DistributedOptimizer.sharded_state` of both, as one model's (the same global
        tensors as the plain optimizer's)."""
        return self._joined([part.sharded_state() for part in self._parts])

    def sharded_state_to_load(self, stored: Callable[[int, str], bool]) -> dict[str, Any]:
        offset = len(self.dense.params)
        requests = [self.dense.sharded_state_to_load(stored)]
        if self.experts is not None:
            requests.append(self.experts.sharded_state_to_load(lambda i, k: stored(offset + i, k)))
        return self._joined(requests)

    def load_sharded_state(self, state_dict: dict[str, Any]) -> None:
        loaded, offset = state_dict.get("state", {}), 0
        for part in self._parts:
            count = len(part.params)
            groups = [
                {**g, "params": members}
                for g, members in zip(state_dict["param_groups"], part.group_members(), strict=True)
            ]
            state = {i - offset: e for i, e in loaded.items() if offset <= i < offset + count}
            part.load_sharded_state({"state": state, "param_groups": groups})
            offset += count

    # --- Megatron's torch format: its ChainedOptimizer of the two, each a list entry

    def param_groups_state(self) -> list[dict[str, Any]] | dict[str, Any]:
        """`model_optim_rng.pt`'s optimizer entry: Megatron's `ChainedOptimizer.state_dict()`,
        one `DistributedOptimizer.param_groups_state()` per part (dense, then experts); a
        stage without experts has one part and, as Megatron's, no list."""
        states = [part.param_groups_state() for part in self._parts]
        return states if len(states) > 1 else states[0]

    def parameter_state_dp_zero(self, chunks: list[nn.Module]) -> Any:
        """`distrib_optim.pt`'s contents, as Megatron's `ChainedOptimizer.save_parameter_state`
        writes them: [dense state, expert state], each gathered over its own group onto that
        group's rank 0 (None in the other ranks' lists); None where neither is (nothing to
        write). Collective over both groups."""
        states = [
            part.parameter_state_dp_zero(part.megatron_buffers(chunks)) for part in self._parts
        ]
        if len(states) == 1:
            return states[0]
        return states if any(s is not None for s in states) else None

    def distrib_optim_sources(self, position: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Per part, the position (this rank's indices) of the rank whose file holds its
        state: each group's rank 0. Collective over both groups."""
        return [part.root_position(position) for part in self._parts]

    def load_parameter_states(
        self, groups_state: Any, files: list[Any], chunks: list[nn.Module], sources: list[str]
    ) -> None:
        """Load each part from the `optimizer` entry and its group root's `distrib_optim.pt`
        contents (`files[i]`, as `parameter_state_dp_zero` wrote it)."""
        groups = groups_state if isinstance(groups_state, list) else [groups_state]
        if len(groups) != len(self._parts):
            raise ValueError(
                f"{sources[0]}: the optimizer state has {len(groups)} parts (dense, experts), "
                f"this run's optimizer {len(self._parts)}; it was saved for another model"
            )
        for index, (part, group, state, source) in enumerate(
            zip(self._parts, groups, files, sources, strict=True)
        ):
            if len(self._parts) > 1:
                if not isinstance(state, list) or len(state) != len(self._parts):
                    raise ValueError(
                        f"{source}: expected Megatron's list of {len(self._parts)} optimizer "
                        "states (dense, experts); it was saved without expert parallelism"
                    )
                state = state[index]
                if state is None:
                    raise ValueError(
                        f"{source}: holds no state of optimizer part {index}; the files were "
                        "saved with another data- or expert-parallel layout"
                    )
            step = part.load_param_groups_state(group)
            part.load_parameter_state(state, part.megatron_buffers(chunks), step, source)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(_TORCH_FORMAT)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError(_TORCH_FORMAT)


_TORCH_FORMAT = (
    "--use-distributed-optimizer with the experts apart saves its torch-format state as "
    "Megatron's pair (param_groups_state, parameter_state_dp_zero), not a full state_dict"
)


def has_expert_parameters(model: nn.Module) -> bool:
    return any(is_expert_parameter(p) for p in model.parameters())
