"""Multi-turn tool-use rollouts of the agent stage (MiniMind's ``rollout_single``/``rollout_batch`` of
``trainer/train_agent.py``, d65ef2c; written anew, docs/rl.md).

A trajectory starts from its prompt (the record's conversation and tools through the chat template). Each turn the
policy samples a reply (every trajectory of the micro-batch that is still going, in one batch, each from its own
seed: rollout.row_seeds with the turn as the round); the reply's ``<tool_call>`` blocks are parsed and run
(rl/tools.py:ToolBox), and their results come back as ``role: tool`` messages rendered by the chat template, after
which the policy samples again; up to ``max_turns`` turns and ``max_total_len`` tokens. A reply without calls ends
the trajectory.

Tokens in, tokens out: the trajectory is the exact token sequence the policy saw, prompt, its own tokens (through
each turn's EOS) and the tool turns' tokens; only its own carry loss (``completion_mask``) and a behaviour log-prob.
The tool turns' text is what the template adds between the reply and the next reply:
``render(history + reply + tool messages, generation prompt)`` after ``render(history + reply)``, plus the
template's end of the reply after the policy's EOS. A template that renders earlier turns differently once later
ones follow is refused (the sequence would not be what the next turn is generated from).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from minimind_ray.rl.rollout import row_seeds
from minimind_ray.rl.tools import parse_tool_calls, tool_schemas

_SENTINEL = "\x00minimind-ray-reply\x00"


@dataclass
class Trajectory:
    """What a reward term sees of one rollout (rl/trajectory_rewards.py)."""

    prompt: str  # the chat-templated prompt, special tokens kept
    messages: List[dict]  # the prompt's messages
    tools: List[dict]  # the tools the record offers (OpenAI function schemas)
    gt: List[str]  # the values a right final answer holds
    turns: List[str] = field(default_factory=list)  # each reply of the policy (special tokens removed)
    calls: List[List[dict]] = field(default_factory=list)  # each reply's parsed calls ({"name", "arguments"})
    responses: List[str] = field(default_factory=list)  # every tool message's content, in order
    bad_calls: int = 0  # <tool_call> blocks that were not JSON with a name
    errors: int = 0  # calls answered with an error (unknown or not offered tool, bad arguments, raised, timed out)
    unfinished: bool = False  # still calling tools after the last turn, or no room left for the next one
    truncated: bool = False  # a reply stopped at max_gen_len or max_total_len without its EOS


def _clean(messages: List[dict]) -> List[dict]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if isinstance(m.get("tool_calls"), str):
            m["tool_calls"] = json.loads(m["tool_calls"])
        out.append(m)
    return out


def _render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tools=tools or None)


def tool_turn_text(tokenizer, history: List[dict], reply: str, contents: List[str], tools, ended: bool) -> str:
    """The text between a reply and the next one: the end of the reply's turn (after the EOS the policy sampled,
    when ``ended``), the tool messages, the next generation prompt, as the chat template renders them."""
    with_reply = history + [{"role": "assistant", "content": reply}]
    before = _render(tokenizer, with_reply, tools, False)
    after = _render(tokenizer, with_reply + [{"role": "tool", "content": c} for c in contents], tools, True)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier turns differently once tool messages follow; the agent "
                         "stage needs a template whose turns are only appended to")
    probe = _render(tokenizer, history + [{"role": "assistant", "content": _SENTINEL}], tools, False)
    end_of_reply = probe.split(_SENTINEL, 1)[1]  # e.g. "<|im_end|>\n"
    eos = tokenizer.eos_token
    if ended:
        if not end_of_reply.startswith(eos):
            raise ValueError(f"the chat template does not end an assistant turn with the EOS token {eos!r}")
        end_of_reply = end_of_reply[len(eos):]
    return end_of_reply + after[len(before):]


def _left_pad(rows: List[List[int]], pad_id: int, device) -> Tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r, dtype=torch.long), 1
    return ids.to(device), mask.to(device)


def _bytes_text(t: Tensor, n: int) -> str:
    return bytes(t[:n].tolist()).decode("utf-8")


def first_turn_request(mb: Dict[str, Tensor], *, params, group_size: int, max_total_len: int, seed: int, step: int,
                       device):
    """(prompt ids, mask, sampling params, seeds) of every trajectory's first turn: what :func:`agent_rollout`
    generates first, and what a plan may send to a pool of rollout actors ahead of time (train.rollout.overlap)."""
    prompts = _prompts(mb)
    rows = [i for i in range(len(prompts) * group_size) if len(prompts[i // group_size]) < max_total_len]
    room = max(max_total_len - len(prompts[i // group_size]) for i in rows)
    ids, mask = _left_pad([prompts[i // group_size] for i in rows], params.pad_id, device)
    seeds = row_seeds(seed, step, mb["sample_ids"], group_size, 0)[torch.tensor(rows)].to(device)
    return ids, mask, dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room)), seeds


def _prompts(mb: Dict[str, Tensor]) -> List[List[int]]:
    prompt_ids, prompt_mask = mb["prompt_ids"].cpu(), mb["prompt_mask"].cpu().bool()
    return [row[m].tolist() for row, m in zip(prompt_ids, prompt_mask)]


def agent_rollout(mb: Dict[str, Tensor], *, engine, params, group_size: int, toolbox, tokenizer, max_turns: int,
                  max_total_len: int, seed: int, step: int, device, first_turn=None
                  ) -> Tuple[List[Trajectory], Dict[str, Tensor]]:
    """One prepared micro-batch of B agent_rl prompts -> B * group_size trajectories and their tensors:
    ``input_ids``/``attention_mask`` (N, P + R), the left-padded prompt then the trajectory; ``completion_mask``
    (N, R), 1 on the policy's own tokens; ``old_logp`` (N, R) their behaviour log-probs; ``total_len`` (N,).
    ``first_turn``: the first turn's rollout of :func:`first_turn_request`, generated ahead (else generated here)."""
    G = group_size
    prompts = _prompts(mb)
    trajs, history = [], []
    for b in range(len(prompts)):
        ctx = json.loads(_bytes_text(mb["context_utf8"][b], int(mb["context_len"][b])))
        gt = json.loads(_bytes_text(mb["answer_utf8"][b], int(mb["answer_len"][b])))
        text = tokenizer.decode(prompts[b])
        for _ in range(G):
            trajs.append(Trajectory(text, ctx["messages"], ctx["tools"], [str(g) for g in gt]))
            history.append(_clean(ctx["messages"]))
    N = len(trajs)
    tokens = [[] for _ in range(N)]  # everything after the prompt
    own = [[] for _ in range(N)]  # 1: the policy's token
    logps = [[] for _ in range(N)]
    going = list(range(N))
    for turn in range(max_turns):
        rows = [i for i in going if len(prompts[i // G]) + len(tokens[i]) < max_total_len]
        for i in set(going) - set(rows):
            trajs[i].unfinished = True  # no room for another turn
        if not rows:
            break
        room = {i: max_total_len - len(prompts[i // G]) - len(tokens[i]) for i in rows}
        if turn == 0:
            request = first_turn_request(mb, params=params, group_size=G, max_total_len=max_total_len, seed=seed,
                                         step=step, device=device)
            roll = first_turn if first_turn is not None else engine.generate(*request[:3], seeds=request[3])
        else:
            ids, mask = _left_pad([prompts[i // G] + tokens[i] for i in rows], params.pad_id, device)
            seeds = row_seeds(seed, step, mb["sample_ids"], G, turn)[torch.tensor(rows)].to(device)
            roll = engine.generate(ids, mask, dataclasses.replace(params, max_new_tokens=min(
                params.max_new_tokens, max(room.values()))), seeds=seeds)
        going = []
        for j, i in enumerate(rows):
            n = min(int(roll.completion_mask[j].sum()), room[i])
            new = roll.completion_ids[j, :n].tolist()
            ended = bool(new) and new[-1] == params.eos_id
            tokens[i] += new
            own[i] += [1] * n
            logps[i] += roll.logprobs[j, :n].tolist()
            t = trajs[i]
            reply = tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=True)
            calls, bad = parse_tool_calls(reply)
            t.turns.append(reply)
            t.calls.append(calls)
            t.bad_calls += bad
            t.truncated |= not ended
            if not calls:
                continue
            if turn == max_turns - 1:
                t.unfinished = True
                continue
            offered = tool_schemas(t.tools)
            contents = []
            for c in calls:
                if c["name"] not in offered:
                    content, failed = json.dumps({"error": f"tool {c['name']!r} is not offered here; the tools are "
                                                           f"{sorted(offered)}"}), True
                    toolbox.errors += 1
                else:
                    content, failed = toolbox.run(c["name"], c["arguments"])
                contents.append(content)
                t.errors += failed
            obs = tokenizer.encode(tool_turn_text(tokenizer, history[i], reply, contents, t.tools, ended))
            if len(prompts[i // G]) + len(tokens[i]) + len(obs) >= max_total_len:
                t.unfinished = True  # the tool turn would leave no room for the answer
                continue
            history[i] += [{"role": "assistant", "content": reply}] + [{"role": "tool", "content": c} for c in contents]
            t.responses += contents
            tokens[i] += obs
            own[i] += [0] * len(obs)
            logps[i] += [0.0] * len(obs)
            going.append(i)
    R = max(len(x) for x in tokens)
    resp = torch.full((N, R), params.pad_id, dtype=torch.long)
    valid, loss_mask, old_logp = (torch.zeros((N, R)) for _ in range(3))
    for i in range(N):
        n = len(tokens[i])
        resp[i, :n], valid[i, :n] = torch.tensor(tokens[i], dtype=torch.long), 1.0
        loss_mask[i, :n], old_logp[i, :n] = torch.tensor(own[i], dtype=torch.float32), torch.tensor(logps[i])
    rep = lambda x: x.to(device).repeat_interleave(G, dim=0)  # noqa: E731
    batch = {"input_ids": torch.cat([rep(mb["prompt_ids"]), resp.to(device)], dim=1),
             "attention_mask": torch.cat([rep(mb["prompt_mask"]).long(), valid.long().to(device)], dim=1),
             "completion_mask": loss_mask.to(device), "old_logp": old_logp.to(device),
             "total_len": torch.tensor([len(p) for p in prompts], dtype=torch.float32).repeat_interleave(G).to(device)
             + valid.sum(dim=1).to(device)}
    return trajs, batch
