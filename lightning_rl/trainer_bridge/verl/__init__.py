"""lightning-rl on verl: the bridge's parts, one module each.

* ``dataproto``: stored samples to verl's ``DataProto`` (your own loop): ``to_dataproto``, ``to_dataprotos``;
* ``data``: tasks to verl's parquet dataset (``train verl --tasks``);
* ``launch``: ``lightning-rl train verl``: the command, and the settings refused before Ray starts;
* ``main``: ``python -m lightning_rl.trainer_bridge.verl.main``, verl's ``main_ppo`` checked and wired;
* ``agent_loop``: the agent loop verl's workers run (``lightning_rl`` in verl's registry);
* ``rows``: a finished rollout to verl's rows, one per trained segment;
* ``advantage``: verl's advantage step by lightning-rl's rules (failures out of the batch, each segment's credit);
* ``gap``: the served log-prob gap (the engine's log-probs against the actor's) and its warning limit;
* ``runs``: a run's record and version base (its publishes' numbering);
* ``trainer``: verl's V1 sync trainer, with that advantage, the gap read every step and a publish per weight sync;
* ``export``: a verl checkpoint to a PEFT adapter and a merged model folder;
* ``config/``: the packaged Hydra config.

The modules that import verl (``agent_loop``, ``trainer``, ``main``) are not imported here: this package imports
without verl. The old paths (``lightning_rl.trainer_bridge.verl_rows`` and the others) still import, as the
same modules.
"""

from .dataproto import to_dataproto, to_dataprotos

__all__ = ["to_dataproto", "to_dataprotos"]
