"""The CPU GRPO demo (`rollout-service demo`): a command on top of both packages.

It trains with `trainer_hooks` against a `rollout-service serve` unit, so it sits above
`trainer_hooks` and `rollout_service`; neither imports it (packages import downward only).
`rollout_demo.cli` is the `rollout-service` console command: rollout_service's CLI plus `demo`.
"""
