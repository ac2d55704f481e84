"""fusedrl.rlhf"""
