"""The draft model: configuration, backbone, sequential and confidence heads, vocabulary subsets, checkpoint formats."""
