"""Model-parallel RNN language model: embedding and decoder on a server, LSTM on the trainer.

This is the "Distributed RNN using Distributed Autograd and Distributed Optimizer" part
of PyTorch's *Getting Started with Distributed RPC Framework* tutorial, written the
asyncio way on asyncrpc.  The model of the word-language-model example is split in
three: the embedding table and the decoder are built on worker ``ps`` with
``asyncrpc.remote`` and used through their RRefs, the LSTM stays on the ``trainer``.
Each step runs in a distributed autograd context: the forward pass crosses to ``ps``
and back twice, ``await asyncrpc.autograd.backward(ctx, [loss])`` walks the graph
across both workers, and a ``DistributedOptimizer`` over the RRefs of every parameter
(local ones wrapped in ``asyncrpc.RRef``) lets each owner update its own.

The task: a character-level language model of a few of Shakespeare's sonnets, which
the script carries (public domain, no download), trained with truncated
backpropagation through time as in the word-language-model example.  It prints the
loss per epoch, a sample of generated text, and ``RESULT loss_ratio=`` (the last
epoch's mean loss over the first's; below 0.5 means it learned).

    python examples/rnn_model_parallel.py              # spawns its 2 workers on loopback
    python examples/rnn_model_parallel.py --smoke      # a short run for the tests
    torchrun --nproc-per-node 2 examples/rnn_model_parallel.py
"""

from __future__ import annotations

import argparse
import time

import torch
from _launch import base_parser, launch, trainer_and_ps
from _progress import progress, say
from torch import nn

import asyncrpc
from asyncrpc.autograd import backward, context
from asyncrpc.optim import DistributedOptimizer

SONNETS = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.

When, in disgrace with fortune and men's eyes,
I all alone beweep my outcast state,
And trouble deaf heaven with my bootless cries,
And look upon myself and curse my fate,
Wishing me like to one more rich in hope,
Featured like him, like him with friends possess'd,
Desiring this man's art and that man's scope,
With what I most enjoy contented least;
Yet in these thoughts myself almost despising,
Haply I think on thee, and then my state,
Like to the lark at break of day arising
From sullen earth, sings hymns at heaven's gate;
For thy sweet love remember'd such wealth brings
That then I scorn to change my state with kings.

That time of year thou mayst in me behold
When yellow leaves, or none, or few, do hang
Upon those boughs which shake against the cold,
Bare ruin'd choirs, where late the sweet birds sang.
In me thou see'st the twilight of such day
As after sunset fadeth in the west,
Which by and by black night doth take away,
Death's second self, that seals up all in rest.
In me thou see'st the glowing of such fire
That on the ashes of his youth doth lie,
As the death-bed whereon it must expire,
Consumed with that which it was nourish'd by.
This thou perceivest, which makes thy love more strong,
To love that well which thou must leave ere long.

Let me not to the marriage of true minds
Admit impediments. Love is not love
Which alters when it alteration finds,
Or bends with the remover to remove:
O no! it is an ever-fixed mark
That looks on tempests and is never shaken;
It is the star to every wandering bark,
Whose worth's unknown, although his height be taken.
Love's not Time's fool, though rosy lips and cheeks
Within his bending sickle's compass come;
Love alters not with his brief hours and weeks,
But bears it out even to the edge of doom.
If this be error and upon me proved,
I never writ, nor no man ever loved.

My mistress' eyes are nothing like the sun;
Coral is far more red than her lips' red;
If snow be white, why then her breasts are dun;
If hairs be wires, black wires grow on her head.
I have seen roses damask'd, red and white,
But no such roses see I in her cheeks;
And in some perfumes is there more delight
Than in the breath that from my mistress reeks.
I love to hear her speak, yet well I know
That music hath a far more pleasing sound;
I grant I never saw a goddess go;
My mistress, when she walks, treads on the ground:
And yet, by heaven, I think my love as rare
As any she belied with false compare.
"""

VOCAB = sorted(set(SONNETS))
INDEX = {ch: i for i, ch in enumerate(VOCAB)}


# -- the two sub-modules that live on the server --------------------------------------


class ServerModule(nn.Module):
    """A module used through an RRef: what its users ask of it besides ``forward``."""

    async def parameter_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        """RRefs of its parameters, made here on their owner (for the optimizer)."""
        return [asyncrpc.RRef(p) for p in self.parameters()]

    def set_training(self, mode: bool) -> None:
        """``train(mode)``, without sending the module back (``train`` returns it)."""
        self.train(mode)


class EmbeddingTable(ServerModule):
    """Encoding layers of the RNN model (token ids -> vectors)."""

    def __init__(self, ntoken: int, ninp: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.encoder(tokens))


class Decoder(ServerModule):
    """Decoding layer of the RNN model (LSTM outputs -> token logits)."""

    def __init__(self, ntoken: int, nhid: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.drop(output))


# -- the model, on the trainer --------------------------------------------------------

Hidden = tuple[torch.Tensor, torch.Tensor]


class RNNModel(nn.Module):
    """Embedding table and decoder on ``ps`` (behind RRefs), LSTM here."""

    def __init__(
        self, ps: str, ntoken: int, *, ninp: int, nhid: int, nlayers: int, dropout: float
    ) -> None:
        super().__init__()
        self.emb_table_rref = asyncrpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder_rref = asyncrpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    async def forward(self, tokens: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        emb = await self.emb_table_rref.rpc_async().forward(tokens)
        output, hidden = self.rnn(emb, hidden)
        decoded = await self.decoder_rref.rpc_async().forward(output)
        return decoded, hidden

    async def parameter_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        """RRefs of every parameter: remote ones from ``ps``, local ones wrapped here."""
        embedding = await self.emb_table_rref.rpc_async().parameter_rrefs()
        decoder = await self.decoder_rref.rpc_async().parameter_rrefs()
        return [*embedding, *(asyncrpc.RRef(p) for p in self.rnn.parameters()), *decoder]

    def init_hidden(self, batch: int) -> Hidden:
        shape = (self.rnn.num_layers, batch, self.rnn.hidden_size)
        return torch.zeros(shape), torch.zeros(shape)


# -- data and training ----------------------------------------------------------------


def batchify(text: str, streams: int) -> torch.Tensor:
    """The text as ``streams`` parallel columns of character ids: ``(length, streams)``."""
    ids = torch.tensor([INDEX[ch] for ch in text])
    length = len(ids) // streams
    return ids[: length * streams].view(streams, length).t().contiguous()


def windows(data: torch.Tensor, bptt: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive ``(input, target)`` windows of ``bptt`` steps (truncated BPTT)."""
    return [
        (data[i : i + bptt], data[i + 1 : i + 1 + bptt].reshape(-1))
        for i in range(0, len(data) - bptt, bptt)
    ]


async def train_epoch(
    model: RNNModel, opt: DistributedOptimizer, data: torch.Tensor, bptt: int
) -> float:
    """One pass over the text; returns the mean loss of its windows."""
    hidden = model.init_hidden(data.shape[1])
    losses = []
    for tokens, target in windows(data, bptt):
        async with context() as ctx:
            hidden = (hidden[0].detach(), hidden[1].detach())  # truncated BPTT
            output, hidden = await model(tokens, hidden)
            loss = nn.functional.cross_entropy(output.view(-1, len(VOCAB)), target)
            await backward(ctx, [loss])
            await opt.step(ctx)
        losses.append(loss.item())
    return sum(losses) / len(losses)


async def sample(model: RNNModel, prompt: str, length: int) -> str:
    """Greedy generation, one character at a time (two RPCs per character)."""
    await model.emb_table_rref.rpc_async().set_training(False)
    await model.decoder_rref.rpc_async().set_training(False)
    model.eval()
    hidden = model.init_hidden(1)
    text = prompt
    with torch.no_grad():
        logits, hidden = await model(batchify(prompt, 1), hidden)
        for _ in range(length):
            nxt = VOCAB[int(logits[-1, 0].argmax())]
            text += nxt
            logits, hidden = await model(torch.tensor([[INDEX[nxt]]]), hidden)
    return text


async def run_trainer(args: argparse.Namespace) -> None:
    model = RNNModel(
        "ps", len(VOCAB), ninp=args.ninp, nhid=args.nhid, nlayers=args.nlayers, dropout=args.dropout
    )
    opt = DistributedOptimizer(torch.optim.Adam, await model.parameter_rrefs(), lr=args.lr)
    data = batchify(SONNETS, args.streams)
    print(
        f"[trainer] {len(SONNETS)} characters, vocabulary {len(VOCAB)}, "
        f"{len(windows(data, args.bptt))} windows of {args.bptt}x{args.streams} per epoch",
        flush=True,
    )
    epochs = args.epochs or (20 if args.smoke else 60)
    started = time.monotonic()
    losses = []
    for epoch in progress(range(epochs), desc="[trainer] epochs"):
        losses.append(await train_epoch(model, opt, data, args.bptt))
        if epoch % args.log_every == 0 or epoch == epochs - 1:
            say(
                f"[trainer] epoch {epoch:3d}  loss {losses[-1]:.3f}  "
                f"({time.monotonic() - started:.1f}s)"
            )
    print(f"[trainer] sample: {await sample(model, 'Shall I', 60)!r}", flush=True)
    print(f"RESULT loss_ratio={losses[-1] / losses[0]:.4f}", flush=True)


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    await trainer_and_ps(rank, world, lambda: run_trainer(args))


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0], world=2)
    parser.add_argument("--epochs", type=int, help="default: 60, or 20 with --smoke")
    parser.add_argument("--streams", type=int, default=16, help="batch: parallel text streams")
    parser.add_argument("--bptt", type=int, default=32, help="truncated BPTT window")
    parser.add_argument("--ninp", type=int, default=32)
    parser.add_argument("--nhid", type=int, default=256)
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--log-every", type=int, default=5)
    launch(worker, parser)


if __name__ == "__main__":
    main()
