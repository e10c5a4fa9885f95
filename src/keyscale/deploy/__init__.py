"""Deployments: a job, its settings and its change policies in one TOML file, kept running.

In the spirit of Ververica Platform: ``keyscale apply deployment.toml`` writes the desired
spec into the deployment's state folder and starts a supervisor process that brings the
running job to it (live rescale, STATEFUL/STATELESS/NONE upgrades, restore strategies,
restarts after failures). ``docs/deployments.md`` documents the semantics.

- :mod:`keyscale.deploy.spec`: a deployment as data; :mod:`keyscale.deploy.file`: its TOML file (:func:`load_deployment`);
- :mod:`keyscale.deploy.plan`: the pure decisions (:func:`plan_action`, :func:`choose_restore`);
- :mod:`keyscale.deploy.store`: the state folder (desired, status, events, job directories);
- :mod:`keyscale.deploy.supervisor`: the process that carries the decisions out;
- :mod:`keyscale.deploy.cli`: ``apply`` and ``deployment status|stop``.

>>> from keyscale.deploy import RestoreStrategy, UpgradeStrategy
>>> UpgradeStrategy.STATEFUL.value, RestoreStrategy.LATEST_STATE.value
('STATEFUL', 'LATEST_STATE')
"""

from keyscale.deploy.file import load_deployment, parse_deployment
from keyscale.deploy.plan import (
    Action,
    ActionKind,
    Current,
    Desired,
    DesiredState,
    Restore,
    RestoreKind,
    Snapshot,
    choose_restore,
    plan_action,
)
from keyscale.deploy.spec import (
    DeploymentError,
    DeploymentSpec,
    RestartStrategy,
    RestoreStrategy,
    UpgradeStrategy,
)

__all__ = [
    "Action",
    "ActionKind",
    "Current",
    "DeploymentError",
    "DeploymentSpec",
    "Desired",
    "DesiredState",
    "RestartStrategy",
    "Restore",
    "RestoreKind",
    "RestoreStrategy",
    "Snapshot",
    "UpgradeStrategy",
    "choose_restore",
    "load_deployment",
    "parse_deployment",
    "plan_action",
]
