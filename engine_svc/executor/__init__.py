"""Executors: what runs the model for the engine core, behind one interface (base.Executor);
factory.build_executor picks one from the engine's config."""
