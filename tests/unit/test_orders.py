"""Order sampling: identity at D = 1, pinning, EOS-last, and the order statistics of method.md 2.5."""
import pytest
import torch

from setdiff_mega.diffusion import (
    StaggeredSchedule,
    invert,
    move_eos_last,
    order_from_exponentials,
    permute,
    sample_exponentials,
    sample_order,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("L", [8, 64, 1024])
def test_d1_gives_identity_order(L):
    s = StaggeredSchedule.create(L, 1)
    perm = sample_order(s, torch.ones(16, L, dtype=torch.bool), _gen())
    assert torch.equal(perm, torch.arange(L).expand(16, L))


def test_order_from_given_exponentials_is_deterministic_and_matches_formula():
    s = StaggeredSchedule.create(32, 4)
    e = sample_exponentials((3, 32), _gen(1))
    perm = order_from_exponentials(s, e)
    T = s.loc + s.b * (1 - torch.exp(-e / s.k))
    assert torch.equal(perm, torch.sort(T, dim=-1, descending=True, stable=True).indices)
    assert torch.equal(perm, order_from_exponentials(s, e.clone()))


def test_pinned_context_and_padding_never_move():
    L, B = 48, 64
    s = StaggeredSchedule.create(L, 8)           # wide windows so everything else moves a lot
    ctx_len = torch.randint(0, 10, (B,), generator=_gen(2))
    pad_len = torch.randint(0, 10, (B,), generator=_gen(3))
    pos = torch.arange(L)
    context = pos[None] < ctx_len[:, None]
    padding = pos[None] >= (L - pad_len)[:, None]
    for seed in range(20):
        perm = sample_order(s, ~(context | padding), _gen(seed))
        for b in range(B):
            c, p = int(ctx_len[b]), int(pad_len[b])
            assert torch.equal(perm[b, :c], torch.arange(c))
            assert torch.equal(perm[b, L - p:], torch.arange(L - p, L))
        assert torch.equal(perm.sort(-1).values, pos.expand(B, L))   # still a permutation


def test_interior_nonpermutable_token_is_not_pinned():
    # Only leading / trailing runs are pinned (reference behaviour); interior ones get a random time.
    L = 32
    s = StaggeredSchedule.create(L, 16, 32)
    permutable = torch.ones(256, L, dtype=torch.bool)
    permutable[:, 10] = False
    perm = sample_order(s, permutable, _gen(4))
    assert (invert(perm)[:, 10] != 10).any()


def _stats(perm):
    B, L = perm.shape
    rank = invert(perm)
    pos = torch.arange(L)
    lag = (rank - pos).abs()
    inv = (perm[:, 1:] < perm[:, :-1]).float().mean().item()
    # max over reveal events of (revealed position - leftmost unrevealed position)
    revealed = torch.zeros(B, L, dtype=torch.bool)
    worst = 0
    for r in range(L):
        frontier = (~revealed).float().argmax(-1)
        worst = max(worst, int((perm[:, r] - frontier).max()))
        revealed[torch.arange(B), perm[:, r]] = True
    return lag.float().mean().item(), int(lag.max()), inv, worst


@pytest.mark.parametrize("D,S,mean_lag,max_lag,p_inv,frontier", [
    (4, 8, 1.75, 7, 0.32, 7), (8, 16, 3.69, 15, 0.38, 15), (16, 32, 7.53, 29, 0.43, 31)])
def test_order_statistics_match_reference_bands(D, S, mean_lag, max_lag, p_inv, frontier):
    L = 1024
    s = StaggeredSchedule.create(L, D, S)
    perm = sample_order(s, torch.ones(64, L, dtype=torch.bool), _gen(0))
    m, mx, inv, fr = _stats(perm)
    assert m == pytest.approx(mean_lag, rel=0.1)
    assert max_lag - 4 <= mx <= S - 1            # never further than S_max - 1 slots
    assert inv == pytest.approx(p_inv, abs=0.03)
    assert fr <= S - 1 and fr >= frontier - 4     # a revealed token is < S_max past the frontier


def test_uniform_limit_s_max_equals_l_is_heavy_tailed():
    s = StaggeredSchedule.create(1024, 4, 1024)
    perm = sample_order(s, torch.ones(16, 1024, dtype=torch.bool), _gen(0))
    lag = (invert(perm) - torch.arange(1024)).abs()
    assert lag.max() > 200


def test_move_eos_last():
    tokens = torch.tensor([[5, 9, 7, 9, 8, 0, 0]])       # 9 = EOS, 0 = pad
    target = torch.tensor([[0, 1, 1, 1, 1, 0, 0]]).bool()
    padding = tokens == 0
    perm = torch.tensor([[0, 3, 1, 2, 4, 5, 6]])
    out = move_eos_last(perm, tokens, target, padding, eos_id=9)
    assert out.tolist() == [[0, 2, 4, 3, 1, 5, 6]]


def test_invert_and_permute():
    perm = torch.stack([torch.randperm(10, generator=_gen(i)) for i in range(4)])
    rank = invert(perm)
    x = torch.arange(40).view(4, 10)
    assert torch.equal(permute(x, perm).gather(1, rank), x)
    assert torch.equal(rank.gather(1, perm), torch.arange(10).expand(4, 10))
    h = torch.randn(4, 10, 3)
    assert torch.equal(permute(h, perm)[1, 2], h[1, perm[1, 2]])
