"""A word-level LSTM language model with truncated BPTT, recorded with retrolog.

Shaped like the language-model script people copy: a corpus batchified into
columns, ``get_batch`` slicing ``bptt`` tokens at a time, the hidden state
carried from batch to batch within an epoch (detached by
``repackage_hidden``), gradient clipping, a hand-written SGD update, and a
learning rate divided by four whenever validation loss stops improving. The
corpus is synthetic (a random first-order Markov chain over a small
vocabulary), so it needs no download and an epoch takes about half a second on
a CPU.

    python examples/word_lm.py --lr 20 --epochs 4 --seed 1
"""

import argparse
import math

import torch
from torch import nn

import retrolog as rl

parser = argparse.ArgumentParser(description="LSTM language model on a synthetic corpus")
parser.add_argument("--emsize", type=int, default=64, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=128, help="hidden units per layer")
parser.add_argument("--nlayers", type=int, default=2, help="number of layers")
parser.add_argument("--lr", type=float, default=20.0, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=4, help="number of epochs")
parser.add_argument("--batch_size", type=int, default=20, help="batch size")
parser.add_argument("--bptt", type=int, default=20, help="sequence length")
parser.add_argument("--dropout", type=float, default=0.2, help="dropout applied to layers")
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--tokens", type=int, default=24000, help="tokens in the training corpus")
args = parser.parse_args()

torch.manual_seed(args.seed)
ntokens = 200


def synthetic_corpus(n, generator):
    """``n`` tokens of a Markov chain whose transitions favour a few successors per word."""
    logits = 3.0 * torch.randn(ntokens, ntokens, generator=torch.Generator().manual_seed(0))
    transitions = torch.softmax(logits, dim=1)
    tokens = torch.empty(n, dtype=torch.long)
    tokens[0] = 0
    draws = torch.rand(n, generator=generator)
    cumulative = transitions.cumsum(dim=1)
    for i in range(1, n):
        tokens[i] = torch.searchsorted(cumulative[tokens[i - 1]], draws[i]).clamp(max=ntokens - 1)
    return tokens


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


corpus = torch.Generator().manual_seed(7)
train_data = batchify(synthetic_corpus(args.tokens, corpus), args.batch_size)
val_data = batchify(synthetic_corpus(4000, corpus), 10)


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid
        self.nlayers = nlayers
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.decoder.out_features)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.nlayers, bsz, self.nhid),
            weight.new_zeros(self.nlayers, bsz, self.nhid),
        )


model = RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)
criterion = nn.NLLLoss()


def repackage_hidden(h):
    """Wrap hidden states in new tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i : i + seq_len]
    target = source[i + 1 : i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(10)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    model.train()
    total_loss = 0.0
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(rl.loop("step", range(0, train_data.size(0) - 1, args.bptt))):
        data, targets = get_batch(train_data, i)
        # Starting each batch, detach the hidden state from how it was previously produced.
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()
        rl.log("loss", loss.item())
    return total_loss / (batch + 1)


lr = args.lr
best_val_loss = None
with rl.checkpointing(model=model):
    for epoch in rl.loop("epoch", range(1, args.epochs + 1)):
        train_loss = train()
        val_loss = evaluate(val_data)
        print(f"epoch {epoch}: train loss {train_loss:.3f}, valid ppl {math.exp(val_loss):.2f}")
        rl.log("val_loss", val_loss)
        if best_val_loss is None or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            # Anneal the learning rate if no improvement has been seen on validation.
            lr /= 4.0
        rl.log("lr_now", lr)

rl.log("best_val_loss", best_val_loss)
