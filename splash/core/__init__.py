"""Bottom layer, no torch: ownership, memory model, page allocator, shapes, requests, wire messages."""
