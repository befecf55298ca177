"""A plain PyTorch training loop under the rlcu scheduler: no rlcu trainer, only the job API.

    rlcu sched serve --cpu-slots 1 &                   # or --gpus all; the token is in <state>/token
    python examples/plain_loop.py --steps 20            # default address: ~/.rlcu/sched/sched.sock

The loop is a toy policy-gradient step (a linear softmax policy over 16 actions; reward 1
for the even ones): sampling is its `rollout`, the REINFORCE update its `actor_train`. What
it shows is the protocol, in the order a loop meets it:

1. register: `client.job(name, clusters)`; a cluster's `resident` memory (weights,
   optimizer state) stays on its device for the job's life, `peak` is the most any phase
   takes. Heartbeats start now, from a daemon thread (every `heartbeat_s`): a job silent for
   the service's heartbeat timeout is declared dead and its leases reclaimed.
2. a phase: `with job.phase("init", mem=...) as lease:` blocks until granted, and releases
   on leaving the block; `lease.names` says where (e.g. "cuda:1": use that device).
3. the preemptible phase: `job.acquire("rollout", mem=..., work=...)`; between two units of
   work (a sampling chunk, an engine step) ask `job.should_yield(lease)`. On a yield the job
   must, promptly: stop at that boundary, keep what it made, free the phase's memory
   (`torch.cuda.empty_cache()` on a GPU: the caching allocator would keep it), release the
   lease, and ask for rollout again with the work left (`work=`): its request keeps its age,
   and it goes on once granted. `job.set_work(left)` keeps the service's split up to date.
4. finish: `job.finish()` (the `with client.job(...)` block does it on a clean exit); a job
   the service ended (cancelled, declared dead) gets `JobEnded` from its next call and stops.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from rlcu.sched.client import JobEnded, SchedClient, SchedError

ACTIONS, FEATURES = 16, 8


def _device(lease) -> torch.device:
    name = lease.names[0].rsplit("/", 1)[-1] if lease.names else "cpu"
    return torch.device(name if name.startswith("cuda:") and torch.cuda.is_available() else "cpu")


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(a) -> dict:
    client = SchedClient(a.addr, a.token)
    clusters = {"actor": {"devices": 1, "resident": a.mem_resident, "peak": max(a.mem_rollout, a.mem_train)}}
    out = {"yields": 0, "steps": 0, "reward": []}
    with client.job(a.name, clusters, heartbeat_s=a.heartbeat_s, poll_s=0.0) as job:
        with job.phase("init", mem=a.mem_rollout) as lease:
            device = _device(lease)
            torch.manual_seed(a.seed)
            policy = torch.nn.Linear(FEATURES, ACTIONS).to(device)
            opt = torch.optim.Adam(policy.parameters(), lr=0.1)
        for _ in range(a.steps):
            # rollout: sample `batch` actions, `chunk` at a time; a yield is honoured between chunks
            lease = job.acquire("rollout", mem=a.mem_rollout, work=a.batch)
            obs, acts = [], []
            while len(acts) < a.batch:
                if job.should_yield(lease):
                    out["yields"] += 1
                    _free(device)
                    job.release(lease)
                    lease = job.acquire("rollout", mem=a.mem_rollout, work=a.batch - len(acts))
                x = torch.randn(a.chunk, FEATURES, device=device)
                with torch.no_grad():
                    acts.append(torch.distributions.Categorical(logits=policy(x)).sample())
                obs.append(x)
                time.sleep(a.chunk_s)  # stands in for a slow generator
                job.set_work(a.batch - len(acts))
            _free(device)
            job.release(lease)
            # actor_train: one REINFORCE step on what was sampled
            with job.phase("actor_train", mem=a.mem_train):
                x, act = torch.cat(obs), torch.cat(acts)
                reward = (act % 2 == 0).float()
                logp = torch.distributions.Categorical(logits=policy(x)).log_prob(act)
                loss = -((reward - reward.mean()) * logp).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                _free(device)
            out["steps"] += 1
            out["reward"].append(float(reward.mean()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a plain PyTorch loop under the rlcu scheduler")
    p.add_argument("--addr", default=None, help="scheduler address (default $RLCU_SCHED_ADDR or the local socket)")
    p.add_argument("--token", default=None, help="the service's token (default $RLCU_SCHED_TOKEN or <state>/token)")
    p.add_argument("--name", default="plain-loop")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sampling chunks per rollout (yield boundaries between them)")
    p.add_argument("--chunk", type=int, default=64, help="samples per chunk")
    p.add_argument("--chunk-s", type=float, default=0.0, help="seconds each chunk takes on top (a slow generator)")
    p.add_argument("--mem-resident", type=float, default=0.1, help="GiB per device held for the job's life")
    p.add_argument("--mem-rollout", type=float, default=0.2, help="GiB the rollout phase takes")
    p.add_argument("--mem-train", type=float, default=0.3, help="GiB the update takes")
    p.add_argument("--heartbeat-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        out = run(a)
    except JobEnded as e:
        print(f"plain_loop: the scheduler ended the job: {e}", file=sys.stderr)
        return 3
    except SchedError as e:
        print(f"plain_loop: scheduler error: {e}", file=sys.stderr)
        return 2
    print(f"plain_loop {a.name}: {out['steps']} steps, yields {out['yields']}, "
          f"reward {out['reward'][0]:.2f} -> {out['reward'][-1]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
