"""Evaluation: the NELBO perplexity bound, infilling ROUGE, GSM-style accuracy, throughput."""
