"""The verifier service: the target model; scores drafts and runs the rejection sampler."""
