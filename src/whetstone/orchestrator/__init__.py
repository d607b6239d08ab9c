"""The orchestrator: keeps inference servers busy with rollouts, scores groups, and feeds the
trainer batches through the batch store, with bounded staleness. See docs/orchestrator.md.

    asyncio.run(Orchestrator(OrchestratorConfig(...)).run())
"""

from whetstone.orchestrator.config import OrchestratorConfig
from whetstone.orchestrator.loop import Orchestrator

__all__ = ["Orchestrator", "OrchestratorConfig"]
