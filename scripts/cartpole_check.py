"""Prove the PPO and A2C components on CartPole-v1 with a small MLP actor-critic.

    python scripts/cartpole_check.py [--algo ppo a2c] [--seed 1] [--steps-ppo 500000] [--steps-a2c 500000]
                                     [--threads 1 2]

Uses exactly the functions the language-model trainer uses: `gae`, `nstep_returns`, `whiten`,
`clipped_surrogate`, `value_loss` from docuchat_rl. Prints, per algorithm, the mean return of the last
20 training episodes and of 20 greedy evaluation episodes of the final policy, for each torch thread count
(the numbers differ with it: a thread count changes the float sums' order, so the run's random path).
Needs the `dev` extra (gymnasium). Targets: PPO >= 475, A2C >= 400. PPO's settings are CleanRL's
ppo.py for CartPole (500k steps, 4 envs x 128 steps, 4 epochs of 4 minibatches, lr 2.5e-4 annealed).
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from docuchat_rl.learning.advantages import gae, nstep_returns, whiten
from docuchat_rl.learning.losses import clipped_surrogate, value_loss


def layer(i: int, o: int, gain: float = 2 ** 0.5) -> nn.Linear:
    lin = nn.Linear(i, o)
    nn.init.orthogonal_(lin.weight, gain)
    nn.init.zeros_(lin.bias)
    return lin


class ActorCritic(nn.Module):
    def __init__(self, obs: int, actions: int):
        super().__init__()
        self.actor = nn.Sequential(layer(obs, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, actions, 0.01))
        self.critic = nn.Sequential(layer(obs, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, 1.0))

    def dist(self, x):
        return torch.distributions.Categorical(logits=self.actor(x))

    def value(self, x):
        return self.critic(x).squeeze(-1)


def make_envs(n: int, seed: int):
    envs = gym.make_vec("CartPole-v1", num_envs=n, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    obs, _ = envs.reset(seed=seed)
    return envs, obs


def rollout(envs, obs, net, n_steps, episode_returns, running):
    """n_steps from every env. dones[t] = 1 when the episode ended with step t's action (the returned
    obs is then the next episode's first, so nothing bootstraps across the boundary)."""
    n = envs.num_envs
    b_obs = torch.zeros(n, n_steps, envs.single_observation_space.shape[0])  # [N, T, obs]
    b_act = torch.zeros(n, n_steps, dtype=torch.long)
    b_logp, b_val, b_rew, b_done = (torch.zeros(n, n_steps) for _ in range(4))  # [N, T]
    for t in range(n_steps):
        x = torch.as_tensor(obs, dtype=torch.float32)
        with torch.no_grad():
            d = net.dist(x)
            a = d.sample()
            b_logp[:, t], b_val[:, t] = d.log_prob(a), net.value(x)
        b_obs[:, t], b_act[:, t] = x, a
        obs, r, term, trunc, _ = envs.step(a.numpy())
        done = np.logical_or(term, trunc)
        b_rew[:, t], b_done[:, t] = torch.as_tensor(r), torch.as_tensor(done, dtype=torch.float32)
        running += r
        for i in np.nonzero(done)[0]:
            episode_returns.append(running[i])
            running[i] = 0.0
    with torch.no_grad():
        next_value = net.value(torch.as_tensor(obs, dtype=torch.float32))  # V of the state after the segment
    return obs, (b_obs, b_act, b_logp, b_val, b_rew, b_done, next_value)


def train_ppo(seed: int, total: int, n_envs=4, n_steps=128, epochs=4, minibatches=4, lr=2.5e-4):
    envs, obs = make_envs(n_envs, seed)
    net = ActorCritic(4, 2)
    opt = torch.optim.Adam(net.parameters(), lr=lr, eps=1e-5)
    returns, running = [], np.zeros(n_envs)
    updates = total // (n_envs * n_steps)
    for u in range(updates):
        opt.param_groups[0]["lr"] = lr * (1 - u / updates)  # linear anneal (CleanRL)
        obs, (o, a, logp, v, r, d, nv) = rollout(envs, obs, net, n_steps, returns, running)
        adv, ret = gae(r, v, d, nv, gamma=0.99, lam=0.95)  # [N, T]
        adv = whiten(adv, torch.ones_like(adv))  # over the whole batch, not per minibatch
        flat = [x.reshape(n_envs * n_steps, *x.shape[2:]) for x in (o, a, logp, v, adv, ret)]
        size = n_envs * n_steps
        for _ in range(epochs):
            perm = torch.randperm(size)
            for idx in perm.split(size // minibatches):
                mo, ma, mlogp, mv, madv, mret = (x[idx] for x in flat)
                dist = net.dist(mo)
                pg, _, _ = clipped_surrogate((dist.log_prob(ma) - mlogp).unsqueeze(-1), madv.unsqueeze(-1),
                                             0.2, 0.2)
                vl = value_loss(net.value(mo), mv, mret, clip=0.2)
                loss = pg.mean() + 0.5 * vl.mean() - 0.01 * dist.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                opt.step()
    return net, returns


def train_a2c(seed: int, total: int, n_envs=8, n_steps=5, lr=7e-4):
    envs, obs = make_envs(n_envs, seed)
    net = ActorCritic(4, 2)
    opt = torch.optim.RMSprop(net.parameters(), lr=lr, alpha=0.99, eps=1e-5)
    returns, running = [], np.zeros(n_envs)
    updates = total // (n_envs * n_steps)
    for u in range(updates):
        opt.param_groups[0]["lr"] = lr * (1 - u / updates)
        obs, (o, a, _, v, r, d, nv) = rollout(envs, obs, net, n_steps, returns, running)
        ret = nstep_returns(r, v, d, nv, gamma=0.99)  # [N, T], bootstrapped at the segment end
        dist = net.dist(o)
        values = net.value(o)
        adv = (ret - values).detach()
        loss = (-(adv * dist.log_prob(a)).mean() + 0.5 * (0.5 * (ret - values) ** 2).mean()
                - 0.0 * dist.entropy().mean())
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
    return net, returns


def greedy_eval(net, seed: int, episodes: int = 20) -> float:
    env = gym.make("CartPole-v1")
    totals = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + 1000 + ep)
        done, total = False, 0.0
        while not done:
            with torch.no_grad():
                a = int(net.actor(torch.as_tensor(obs, dtype=torch.float32)).argmax())
            obs, r, term, trunc, _ = env.step(a)
            total += r
            done = term or trunc
        totals.append(total)
    return float(np.mean(totals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", nargs="+", default=["ppo", "a2c"], choices=["ppo", "a2c"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps-ppo", type=int, default=500_000)
    ap.add_argument("--steps-a2c", type=int, default=500_000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    a = ap.parse_args()
    for threads, algo in ((t, x) for t in a.threads for x in a.algo):
        torch.set_num_threads(threads)
        torch.manual_seed(a.seed)
        np.random.seed(a.seed)
        t0 = time.time()
        train = train_ppo if algo == "ppo" else train_a2c
        net, returns = train(a.seed, a.steps_ppo if algo == "ppo" else a.steps_a2c)
        last = float(np.mean(returns[-20:]))
        print(f"{algo}, {threads} thread{'s' * (threads > 1)}: {len(returns)} episodes in "
              f"{(time.time() - t0) / 60:.1f} min; "
              f"mean return of the last 20 training episodes {last:.1f}; "
              f"greedy evaluation over 20 episodes {greedy_eval(net, a.seed):.1f}", flush=True)


if __name__ == "__main__":
    main()
