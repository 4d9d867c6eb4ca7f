"""FX rewriter (converted model → torch.fx.GraphModule of custom ops). Not built yet: see issue 4."""
