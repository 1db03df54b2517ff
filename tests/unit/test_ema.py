"""The EMA recurrence and the evaluation swap on a plain module (no megatron-core needed)."""
import torch

from setdiff_mega.training.ema import EMA


def test_ema_is_the_lerp_recurrence_and_the_swap_restores_the_raw_weights():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    ema = EMA(net, 0.9)
    want = [p.detach().clone() for p in net.parameters()]
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        want = [w + 0.1 * (p.detach() - w) for w, p in zip(want, net.parameters())]
    for s, w in zip(ema.shadow, want):
        torch.testing.assert_close(s, w, rtol=0, atol=1e-6)
    raw = [p.detach().clone() for p in net.parameters()]
    with ema.swapped():
        assert all(torch.equal(p, s) for p, s in zip(net.parameters(), ema.shadow))
    assert all(torch.equal(p, r) for p, r in zip(net.parameters(), raw))


def test_bf16_parameters_keep_an_fp32_ema():
    net = torch.nn.Linear(4, 4).to(torch.bfloat16)
    ema = EMA(net, 0.999)
    assert all(s.dtype == torch.float32 for s in ema.shadow)
    w0 = net.weight.detach().float()
    with torch.no_grad():
        net.weight.add_(1.0)
    ema.update()                     # a 0.001 step, far below bf16's resolution, survives in fp32
    torch.testing.assert_close(ema.shadow[0], w0 + 0.001 * (net.weight.float() - w0), rtol=0, atol=1e-6)
    assert not torch.equal(ema.shadow[0].to(torch.bfloat16).float(), ema.shadow[0])
