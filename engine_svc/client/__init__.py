"""Engine-core clients: one interface, in process or across processes."""
