"""Model code: nn.Modules, loaders and kernels. Imports torch only, never the engine, text or server."""
