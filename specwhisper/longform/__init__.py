"""Long-form transcription: openai-whisper's seek loop, window decoding, word timestamps."""
