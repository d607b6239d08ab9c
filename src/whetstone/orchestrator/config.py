"""Config of the orchestrator: which servers, which tasks, how big the groups and batches are,
how advantages are made, how stale a sample may be, and where batches and weights live."""

from __future__ import annotations

from pydantic import Field, model_validator

from whetstone.config import Config
from whetstone.envs.harness import EndpointConfig, HarnessConfig, RolloutConfig
from whetstone.envs.harness.config import ApiRoot
from whetstone.envs.tasks import TasksConfig
from whetstone.inference.sampling import GREEDY_BELOW
from whetstone.orchestrator.curriculum import CurriculumConfig
from whetstone.rl.advantages import AdvantageConfig
from whetstone.rl.staleness import StalenessConfig
from whetstone.utils.tracking import TrackingConfig


class OrchestratorConfig(Config):
    servers: list[ApiRoot] = ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]
    """API roots of the inference servers (`whetstone serve`, vLLM, SGLang), on any machine."""
    endpoint: EndpointConfig = EndpointConfig()
    """Request settings shared by every server (model, key, timeout, retries); its `base_url` is
    not used: the addresses are `servers`."""
    harness: HarnessConfig = HarnessConfig()
    """The agent loop each rollout runs (budgets, tokenizer)."""
    rollout: RolloutConfig = RolloutConfig(concurrency=16)
    """Sandbox and grading of each rollout; `concurrency` is the most rollouts in flight over all servers."""
    tasks: TasksConfig = TasksConfig()
    """Where the training tasks come from (default: the synth train split)."""
    validate_tasks: bool = True
    """Run each task's tests in a sandbox first and skip tasks that do not validate."""
    validate_lazily: bool = True
    """Validate each task just before its first group instead of all of them at start, so a
    large task set costs only the tasks used (invalid ones are skipped, logged and counted)."""
    group_size: int = Field(8, ge=2)
    """Rollouts per task in one group (the baseline of the group advantage)."""
    groups_per_batch: int = Field(4, ge=1)
    """Kept groups (after dropping, see `advantages`) in one batch."""
    max_fruitless_batches: int = Field(20, ge=0)
    """Stop, saying why, once this many batches' worth of groups in a row gave nothing to train on
    (the policy solves every task, or none): more rollouts would not move it. 0: wait for ever."""
    advantages: AdvantageConfig = AdvantageConfig()
    """Estimator and group filtering."""
    curriculum: CurriculumConfig = CurriculumConfig()
    """Tasks whose last group was all solved or all failed sit out a few passes over the task set
    (orchestrator/curriculum.py); nothing changes in a run shorter than one pass."""
    staleness: StalenessConfig = StalenessConfig()
    """How far behind the trainer a sample may be; also how many batches the orchestrator may run ahead."""
    batch_store: str = "runs/default/batches"
    """Where batches go: a local directory or s3://bucket/prefix."""
    weight_store: str = "runs/default/weights"
    """The trainer's weight store (read only: its latest version is the trainer's progress)."""
    store_endpoint_url: str | None = None
    """S3 endpoint of both stores for non-AWS object stores (MinIO, R2, moto); None = AWS."""
    seed: int = 0
    """Seed of the task order (tasks are shuffled once per pass over the set)."""
    synchronous: bool = False
    """Alternate strictly with the trainer (the synchronous baseline of `whetstone bench pipeline`):
    the groups of batch n start only once the trainer has published version n and every server
    holds it, and only as many as batch n still needs, so every sample is on-policy. Off = run up
    to `staleness.max_off_policy_steps` batches ahead (asynchronous RL)."""
    max_batches: int = Field(0, ge=0)
    """Stop after putting this many batches in this run (0 = run until stopped)."""
    total_batches: int = Field(0, ge=0)
    """Stop once the batch store holds batches 0 .. total_batches - 1, counting those earlier
    runs put (0 = no such bound): an orchestrator restarted mid-run stops where the first would
    have (`max_batches` counts this run's only)."""
    poll_interval_s: float = Field(0.5, gt=0, allow_inf_nan=False)
    """Seconds between checks of the weight store while waiting for the trainer."""
    health_interval_s: float = Field(2.0, gt=0)
    """Seconds between health checks of servers that are out of the pool."""
    no_server_timeout_s: float = Field(600.0, gt=0)
    """Give up when no server has been healthy for this long."""
    discover_servers: bool = False
    """Also use the servers announced in the weight store's fleet registry (`whetstone serve`
    with `fleet.announce`): new ones join within `health_interval_s`, ones that stop or go
    silent are dropped, and their rollouts move to others. `servers` may then be empty."""
    server_heartbeat_timeout_s: float = Field(10.0, gt=0)
    """An announced server whose heartbeat is this many seconds old is forgotten (several of
    its `fleet.heartbeat_s`)."""
    forget_servers_after_s: float = Field(300.0, gt=0)
    """An announced server silent this long has its record deleted from the registry (it died
    without removing it): longer than `server_heartbeat_timeout_s`, so one cut off for a while
    can come back."""
    metrics_path: str | None = None
    """JSONL file getting one record per batch put (counts, reward, staleness, server health)."""
    status_path: str | None = None
    """JSON file of the running totals (groups finished and kept, rollouts dropped by reason,
    batches put; `stopped`, why it gave up, once it has), rewritten atomically at most once a
    second as groups finish, at every batch and when the run ends: what a wait for the next batch
    is waiting on."""
    tracking: TrackingConfig = TrackingConfig()
    """Where the metrics go besides `metrics_path` (used only with it): TensorBoard (on), Weights & Biases (off)."""

    @model_validator(mode="after")
    def _servers_given(self) -> OrchestratorConfig:
        if not self.servers and not self.discover_servers:
            raise ValueError(
                "servers is empty: give at least one inference server address, or set discover_servers = true"
            )
        if len(set(self.servers)) != len(self.servers):
            raise ValueError(f"servers lists an address twice: {self.servers}")
        sampling = self.harness.sampling
        if sampling.temperature < GREEDY_BELOW or sampling.top_p < 1 or sampling.top_k:
            # the trainer reproduces logits / T, not a distribution cut down to its top tokens
            raise ValueError(
                f"harness.sampling: RL trains on the sampled distribution, so it needs temperature >= "
                f"{GREEDY_BELOW:g} (below it the engine samples greedily) "
                f"and no truncation (top_p = 1, top_k = 0); got temperature {sampling.temperature}, "
                f"top_p {sampling.top_p}, top_k {sampling.top_k}"
            )
        return self

    @model_validator(mode="after")
    def _groups_can_be_kept(self) -> OrchestratorConfig:
        if self.advantages.min_group_size > self.group_size:
            # every group would be dropped as `small_group`: rollouts spent for nothing, for ever
            raise ValueError(
                f"advantages.min_group_size ({self.advantages.min_group_size}) exceeds group_size "
                f"({self.group_size}): no group could be kept; lower advantages.min_group_size or raise group_size"
            )
        if self.forget_servers_after_s <= self.server_heartbeat_timeout_s:
            # a server's record would go while the pool still counts it alive
            raise ValueError(
                f"forget_servers_after_s ({self.forget_servers_after_s:g}) must be longer than "
                f"server_heartbeat_timeout_s ({self.server_heartbeat_timeout_s:g})"
            )
        return self
