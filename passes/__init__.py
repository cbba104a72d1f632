"""fastopt.passes: torch.fx tracing and rewrites onto fastopt.codegen operators."""

__all__: list = []
