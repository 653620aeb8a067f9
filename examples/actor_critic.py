"""An actor-critic agent on CartPole, shaped like the reinforcement-learning script everyone copies.

One network with an action head and a value head; ``select_action()`` samples
an action each step and keeps what the update needs on the module itself
(``model.saved_actions``, ``model.rewards``, Python lists); ``finish_episode()``
turns the episode's rewards into normalized returns, backpropagates the policy
and value losses, steps Adam and empties the lists. The environment is
gymnasium's CartPole (no download); an episode takes milliseconds.

By default a saved action is data: the state the agent saw and the action it
took, and ``finish_episode()`` runs the network again over the episode's states
for the log-probabilities and values it backpropagates through. With
``--keep-graph`` it keeps the step's log-probability and value tensors instead,
as the original does: they carry the autograd graph, which a checkpoint cannot
hold, so a replay executes the step loops of such a run rather than restoring
them (docs/replay.md, "What a checkpoint holds").

The environment is reset with a seed per episode. It is not a checkpointed
object: where a replay skips an episode's step loop, the environment is left as
it was before it, and the next episode's seeded reset makes that state
irrelevant.

    python examples/actor_critic.py --episodes 40 --seed 543
"""

import argparse

import gymnasium as gym
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

import retrolog as rl


class Policy(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.affine1 = nn.Linear(4, hidden)
        self.action_head = nn.Linear(hidden, 2)
        self.value_head = nn.Linear(hidden, 1)
        # What one episode needs for its update, filled step by step.
        self.saved_actions = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.affine1(x))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


def select_action(model, state, keep_graph):
    state = torch.from_numpy(state).float()
    if keep_graph:
        probs, value = model(state)
        m = Categorical(probs)
        action = m.sample()
        model.saved_actions.append((m.log_prob(action), value))
    else:
        with torch.no_grad():
            probs, _ = model(state)
        action = Categorical(probs).sample()
        model.saved_actions.append((state, action.item()))
    return action.item()


def finish_episode(model, optimizer, gamma, keep_graph):
    eps = torch.finfo(torch.float32).eps
    returns = []
    R = 0.0
    for r in model.rewards[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    if keep_graph:
        log_probs = torch.stack([log_prob for log_prob, _ in model.saved_actions])
        values = torch.stack([value for _, value in model.saved_actions]).squeeze(-1)
    else:
        states = torch.stack([state for state, _ in model.saved_actions])
        actions = torch.tensor([action for _, action in model.saved_actions])
        probs, values = model(states)
        log_probs = Categorical(probs).log_prob(actions)
        values = values.squeeze(-1)
    advantage = returns - values.detach()
    policy_loss = -(log_probs * advantage).sum()
    value_loss = F.smooth_l1_loss(values, returns, reduction="sum")
    optimizer.zero_grad()
    loss = policy_loss + value_loss
    loss.backward()
    optimizer.step()
    del model.rewards[:]
    del model.saved_actions[:]
    return loss.item()


def main():
    parser = argparse.ArgumentParser(description="Actor-critic on CartPole")
    parser.add_argument("--gamma", type=float, default=0.99, help="discount factor")
    parser.add_argument("--lr", type=float, default=3e-2, help="learning rate")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units")
    parser.add_argument("--seed", type=int, default=543, help="random seed")
    parser.add_argument("--episodes", type=int, default=40, help="episodes to train")
    parser.add_argument("--max-steps", type=int, default=500, help="steps per episode at most")
    parser.add_argument("--log-interval", type=int, default=10, help="episodes between prints")
    parser.add_argument(
        "--keep-graph",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep each step's log-probability and value tensors (the autograd graph)",
    )
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    env = gym.make("CartPole-v1")
    model = Policy(args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    running_reward = 10.0
    with rl.checkpointing(model=model, optimizer=optimizer):
        for i_episode in rl.loop("episode", range(args.episodes)):
            state, _ = env.reset(seed=args.seed + i_episode)
            ep_reward = 0.0
            for t in rl.loop("step", range(1, args.max_steps + 1)):
                action = select_action(model, state, args.keep_graph)
                state, reward, terminated, truncated, _ = env.step(action)
                model.rewards.append(reward)
                ep_reward += reward
                if terminated or truncated:
                    break
            running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
            loss = finish_episode(model, optimizer, args.gamma, args.keep_graph)
            rl.log("ep_reward", ep_reward)
            rl.log("running_reward", running_reward)
            rl.log("loss", loss)
            if i_episode % args.log_interval == 0:
                print(
                    f"Episode {i_episode}\tLast reward: {ep_reward:.2f}"
                    f"\tAverage: {running_reward:.2f}"
                )
            if running_reward > env.spec.reward_threshold:
                print(f"Solved! Running reward is now {running_reward} after {t} steps")
                break
    env.close()


if __name__ == "__main__":
    main()
