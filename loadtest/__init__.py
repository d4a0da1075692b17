"""Load tests (Locust) and the batch-size sweep benchmark."""
