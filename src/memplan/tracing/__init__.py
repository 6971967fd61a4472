"""One training step under the tracer (torch): the fake-tensor forward, capture into a Graph,
measurement of peaks and step times."""
