"""Multi-token prediction (model/mtp.py, issue 35): packed documents never predict across a
boundary, and the losses join the objective in the step's sum form."""

import pytest
import torch

from ndtrain.data.batch import IGNORE, MicroBatch
from ndtrain.model.args import PRESETS
from ndtrain.model.llama import Transformer
from ndtrain.model.loss import TokenLoss
from ndtrain.model.moe import RoutingLog
from ndtrain.model.mtp import MTPStep, depth_batch

ARGS = PRESETS["deepseek-v3-tiny"].with_(mtp_depth=2)


def _model():
    torch.manual_seed(0)
    model = Transformer(ARGS).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    return model


def _mtp_loss(model, mb):
    """The MTP term one forward adds to the objective, and the per-module sums."""
    routing = RoutingLog()
    routing.mtp = MTPStep(TokenLoss(), 1.0, mb)
    model(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids, routing=routing)
    return routing.take_loss(), routing.mtp.sums


def _row(tokens):
    t = torch.tensor([tokens])
    return MicroBatch(tokens=t[:, :-1], targets=t[:, 1:].clone())


@pytest.mark.slow  # the default tier's budget (issue 35)
def test_packed_documents_take_the_mtp_losses_of_each_document_alone():
    """A row packing documents A and B (positions restarting, B's first target IGNORE as the
    packer leaves it) has exactly the MTP loss of A's row plus B's row: no module at a
    position of A reads or predicts a token of B."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 512, (13,), generator=g).tolist(), torch.randint(3, 512, (9,), generator=g).tolist()
    alone = [_mtp_loss(model, _row(doc)) for doc in (a, b)]
    tokens = torch.tensor([a + b])
    targets = torch.cat((tokens[:, 1:], torch.full((1, 1), IGNORE)), 1)
    targets[0, len(a) - 1] = IGNORE  # A's last token does not predict B's first
    packed = MicroBatch(tokens=tokens, targets=targets,
                        positions=torch.tensor([list(range(len(a))) + list(range(len(b)))]),
                        doc_ids=torch.tensor([[0] * len(a) + [1] * len(b)]))
    loss, sums = _mtp_loss(model, packed)
    torch.testing.assert_close(loss, alone[0][0] + alone[1][0], rtol=1e-12, atol=0)
    for d in (1, 2):
        torch.testing.assert_close(sums[d], alone[0][1][d] + alone[1][1][d], rtol=1e-12, atol=0)


def test_module_d_predicts_the_token_d_plus_one_after_the_next():
    mb = MicroBatch(tokens=torch.tensor([[10, 11, 12, 13, 14]]), targets=torch.tensor([[11, 12, 13, 14, 15]]),
                    doc_ids=torch.tensor([[0, 0, 0, 1, 1]]))
    d2 = depth_batch(mb, 2)
    assert d2.tokens.tolist() == [[12, 13, 14, 0, 0]]
    # position 0 reads t2 = 12 and predicts t3 = 13; position 1 would read t3 of document 1: none
    assert d2.targets.tolist() == [[13, IGNORE, IGNORE, IGNORE, IGNORE]]


def test_mtp_blocks_record_routing_statistics_and_add_no_balance_loss(one_thread):
    """The MTP blocks' MoE (model/mtp.py) records its loads as "mtp.d" (every token's k
    slots), and adds no balance loss: the objective's model losses are the main MoE blocks'
    balance losses and the MTP term, nothing more."""
    model = _model()
    tokens = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    mb = MicroBatch(tokens=tokens, targets=tokens.roll(-1, 1))
    routing = RoutingLog(aux_coef=0.01)
    routing.mtp = MTPStep(TokenLoss(), 1.0, mb)
    model(mb.tokens, routing=routing)
    moe_layers = [str(i) for i in range(ARGS.n_layers) if ARGS.is_moe_layer(i)]
    assert sorted(routing.counts) == sorted(moe_layers + ["mtp.1", "mtp.2"])
    for d in (1, 2):
        assert routing.counts[f"mtp.{d}"].sum() == tokens.numel() * ARGS.moe_top_k
    assert len(routing.pending) == len(moe_layers) + 1
