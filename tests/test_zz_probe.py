import math, torch, nanhunt, pytest
import models as M
@pytest.mark.parametrize("n", [16, 64, 256, 1024])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_probe(n, k):
    m = M.EmptyThenFill(); x = M.batch(n, 16)
    hits = 0
    for _ in range(10):
        junk = [torch.full((n, 16), math.nan) for _ in range(k)]
        del junk
        with nanhunt.trace(m) as t:
            m(x)
        hits += t.first is not None
    print("\nPROBE", n, k, hits)
