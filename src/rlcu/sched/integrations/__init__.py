"""Other frameworks' trainers under the rlcu scheduler, each on the public client API only
(`rlcu.sched.client.SchedClient` / `JobHandle`).

    trl.py    TRL's GRPOTrainer: `scheduled(trainer, addr=..., job=...)` (needs `pip install rlcu[trl]`)

A loop of your own needs no integration: see the job API in `rlcu.sched.client` and
`examples/plain_loop.py`.
"""
