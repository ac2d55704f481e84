"""Single-process PPO on the embedded debug task, from fusedrl's PPO pieces only.

Checks that the debug assets are learnable (the true score rises) independently of the
distributed trainer; prints one line per iteration and, at the end, the first/last averages.

    PYTHONPATH=. python scripts/debug_ppo_check.py --assets assets/debug --iters 40
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from fusedrl.components.lr_schedule import build_lr_scheduler
from fusedrl.components.optimizer import build_optimizer, clip_grad_norm
from fusedrl.components.tokenizer import load_tokenizer
from fusedrl.models import build_model
from fusedrl.models.hf import load_hf_checkpoint
from fusedrl.rlhf import Experience, PolicyLoss, ValueLoss, gae, kl_shaped_rewards, shift_to_tokens, token_logprobs, whiten
from fusedrl.tasks.debug import sample_prompts, sample_responses, true_score


def rollout(actor, ref, critic, reward, tok, prompts, max_new_tokens, seed):
    responses, finished = sample_responses(actor, tok, prompts, max_new_tokens, seed=seed)
    seqs, masks = [], []
    for p, r, f in zip(prompts, responses, finished):
        ids = tok.encode(p, add_bos=True)
        resp = r + [tok.eos_id] * f
        seqs.append(ids + resp)
        masks.append([0] * len(ids) + [1] * len(resp))
    width = max(map(len, seqs))
    tokens = torch.tensor([s + [tok.pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    with torch.no_grad():
        logprobs = token_logprobs(actor(tokens), tokens) * mask
        ref_logprobs = token_logprobs(ref(tokens), tokens) * mask
        values = shift_to_tokens(critic(tokens).squeeze(-1)) * mask
        last = torch.tensor([len(s) - 1 for s in seqs])
        scores = reward(tokens).squeeze(-1).gather(1, last[:, None]).squeeze(1)
    true = [true_score(p, tok.decode(r), f) for p, r, f in zip(prompts, responses, finished)]
    exp = Experience(tokens, mask, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores)
    return exp, true


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", default="assets/debug")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--kl-coef", type=float, default=0.02)
    ap.add_argument("--actor-lr", type=float, default=5e-4)
    ap.add_argument("--critic-lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tok = load_tokenizer(f"{args.assets}/tokenizer")
    actor = build_model("debug", "policy")
    load_hf_checkpoint(actor, f"{args.assets}/actor", "debug", "policy")
    ref = copy.deepcopy(actor).eval()
    reward = build_model("debug", "value")
    load_hf_checkpoint(reward, f"{args.assets}/reward", "debug", "value")
    critic = copy.deepcopy(reward)
    reward.eval()
    a_opt, c_opt = build_optimizer(actor, args.actor_lr), build_optimizer(critic, args.critic_lr)
    a_sched = build_lr_scheduler(a_opt, 2, args.iters * args.epochs * (args.batch // args.minibatch), "constant")
    policy_loss, value_loss = PolicyLoss(0.2, 0.0), ValueLoss(0.2)
    history = []
    t0 = time.perf_counter()
    for it in range(args.iters):
        prompts = sample_prompts(args.batch, seed=10_000 + it)
        exp, true = rollout(actor, ref, critic, reward, tok, prompts, args.max_new_tokens, seed=it)
        exp.token_rewards, kl = kl_shaped_rewards(
            exp.scores, exp.logprobs, exp.ref_logprobs, exp.response_mask, args.kl_coef, "k1"
        )
        exp.advantages, exp.returns = gae(exp.token_rewards, exp.values, exp.response_mask, 1.0, 0.95)
        exp.advantages = whiten(exp.advantages, exp.response_mask)
        g = torch.Generator().manual_seed(it)
        for _ in range(args.epochs):
            for mb in exp.minibatches(args.minibatch, g):
                loss, ps = policy_loss(actor(mb.tokens), mb.targets(*PolicyLoss.target_names))
                a_opt.zero_grad()
                loss.backward()
                clip_grad_norm(actor.parameters(), 1.0)
                a_opt.step()
                a_sched.step()
                vloss, vs = value_loss(critic(mb.tokens), mb.targets(*ValueLoss.target_names))
                c_opt.zero_grad()
                vloss.backward()
                clip_grad_norm(critic.parameters(), 1.0)
                c_opt.step()
        mean_true = sum(true) / len(true)
        history.append(mean_true)
        n_tok = exp.response_mask.sum(1)
        kl_mean = (kl.sum() / exp.response_mask.sum()).item()
        print(
            f"iter {it:3d} t={time.perf_counter() - t0:6.1f}s true={mean_true:+.3f} rm={exp.scores.mean():+.3f} "
            f"exact={sum(t == 1.0 for t in true) / len(true):.2f} kl={kl_mean:.4f} len_mean={n_tok.mean():.1f} "
            f"len_max={int(n_tok.max())} clip={ps['clip_frac']:.3f} ev={vs['explained_variance']:.2f}",
            flush=True,
        )
    k = max(1, len(history) // 4)
    print(f"true score: first {k} iters {sum(history[:k]) / k:+.3f} -> last {k} iters {sum(history[-k:]) / k:+.3f}")


if __name__ == "__main__":
    main()
