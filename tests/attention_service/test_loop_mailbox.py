"""LoopMailbox: the engine thread's outputs reach the event loop in order, with one wake-up for
those that arrive together."""
import asyncio
import threading

from splitmoe.attention_service.server import LoopMailbox


def test_outputs_posted_together_arrive_in_order_with_one_wakeup():
    async def main():
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wakeups
            wakeups += 1
            return real(callback, *args)

        loop.call_soon_threadsafe = counting
        mailbox = LoopMailbox(loop)
        queues = [asyncio.Queue() for _ in range(4)]

        def engine_step():  # one step's outputs, posted from another thread while the loop waits
            for step in range(3):
                for i, q in enumerate(queues):
                    mailbox.post(q, (step, i))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # nothing was delivered yet: the loop did not run meanwhile
        got = [[await asyncio.wait_for(q.get(), 5) for _ in range(3)] for q in queues]
        assert got == [[(step, i) for step in range(3)] for i in range(4)]
        assert wakeups == 1
        mailbox.post(queues[0], "later")  # after a delivery, the next post wakes the loop again
        assert await asyncio.wait_for(queues[0].get(), 5) == "later"
        assert wakeups == 2

    asyncio.run(main())
