"""Online RL from real users: the servers keep each response (`capture`, `store`), users rate
them (POST /v1/feedback), and `whetstone online` turns fresh feedback on the deployed model into
a gated policy-gradient update that the servers hot-swap (`loop`). See docs/online.md.

Nothing is imported here, so `whetstone serve` loads only the feedback config it needs.
"""
